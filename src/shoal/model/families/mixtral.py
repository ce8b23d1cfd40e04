"""Mixtral: Mistral's attention with a mixture of experts in every layer (softmax over the experts,
the best k, their weights renormalised). Its Hugging Face files name the router
`block_sparse_moe.gate` and each expert's gate, down and up projections w1, w2 and w3; llama.cpp
writes it as a `llama` file with expert tensors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shoal.model.families.chat_templates import MISTRAL
from shoal.model.families.family import Family
from shoal.model.families.windows import every_layer

if TYPE_CHECKING:
    from shoal.model.config import LlamaConfig

_MOE, _EXPERT_PROJECTIONS = "block_sparse_moe.", {"w1": "gate_proj", "w2": "down_proj", "w3": "up_proj"}


def unfuse(name: str, tensor: torch.Tensor, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """block_sparse_moe.gate as mlp.gate; block_sparse_moe.experts.{e}.w1/w2/w3 as
    mlp.experts.{e}.gate_proj/down_proj/up_proj; others as named."""
    if _MOE not in name:
        return {name: tensor}
    prefix, rest = name.split(_MOE)
    parts = rest.split(".")
    if parts[0] == "experts" and len(parts) == 4 and parts[2] in _EXPERT_PROJECTIONS:
        rest = f"experts.{parts[1]}.{_EXPERT_PROJECTIONS[parts[2]]}.{parts[3]}"
    return {f"{prefix}mlp.{rest}": tensor}


def hf_settings(raw: dict[str, Any]) -> dict[str, Any]:
    return {"normalize_expert_weights": True}


FAMILY = Family(
    name="mixtral",
    hf_model_types=("mixtral",),
    gguf_architectures=(),
    windows=every_layer,
    hf_settings=hf_settings,
    fused_tensors=tuple(f"{p}.weight" for p in _EXPERT_PROJECTIONS) + ("block_sparse_moe.gate.weight",),
    unfuse=unfuse,
    chat_template=MISTRAL,
)
