"""What an engine config's "auto" device and dtype are on this machine (values found at run time
are returned, never written back into the config)."""

from __future__ import annotations

import torch

from shoal.config.engine import EngineConfig
from shoal.model.cpu_features import effective_cpu_features
from shoal.model.errors import ModelLoadError
from shoal.model.native_kernels import load_native_kernels
from shoal.model.registry import resolve_model


def resolve_device(config: EngineConfig, rank: int = 0) -> torch.device:
    """The device of tensor-parallel rank `rank`: on CUDA, the rank-th GPU from the one named."""
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


def keeps_quantized(config: EngineConfig, device: torch.device) -> bool:
    """Whether the model's GGUF-quantized matrices stay quantized: asked for, a GGUF model, a CPU
    device where the native matrix multiply builds (AVX2 or more), and private packed weights
    (`packs_weights`)."""
    if not config.keep_quantized or not config.packs_weights or device.type != "cpu":
        return False
    try:
        gguf = resolve_model(config.model).kind == "gguf"
    except ModelLoadError:
        return False  # the load reports it
    return gguf and load_native_kernels() is not None


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """auto: bfloat16 where the hardware computes it natively (CUDA; CPUs whose effective features,
    under SHOAL_CPU_ISA, include AVX512-BF16 or AMX), else float32. Quantized weights stay exact
    either way: against bfloat16 activations their blocks run as bf16 dot products of exact
    integers, at twice float32's multiply-adds per instruction (csrc/linear_cpu.cpp)."""
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    if device.type == "cuda" or effective_cpu_features().native_bf16:
        return torch.bfloat16
    return torch.float32
