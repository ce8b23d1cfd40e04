"""How an MLP's gate meets its up projection (LlamaConfig.mlp_activation), in torch: act(gate) * up
with SiLU (SwiGLU) or GELU's tanh approximation (GeGLU), or gpt-oss's clamped SwiGLU. The native
kernels' Gate (csrc/decoder_layer_cpu.cpp) computes the same operations, rounded alike, and
GATE_KINDS numbers each kind as it does."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from shoal.model.config import LlamaConfig

GATE_KINDS = {"silu": 0, "gelu_tanh": 1, "swiglu_clamped": 2}


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """gpt-oss: g = min(gate, limit), (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def gate_function(config: LlamaConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """(gate, up) -> the MLP's activation, for `config`'s kind."""
    if config.mlp_activation == "swiglu_clamped":
        return functools.partial(clamped_swiglu, alpha=config.swiglu_alpha, limit=config.swiglu_limit)
    act = (
        nn.functional.silu
        if config.mlp_activation == "silu"
        else functools.partial(nn.functional.gelu, approximate="tanh")
    )
    return lambda gate, up: act(gate) * up
