"""What an engine config's "auto" device and dtype are on this machine (values found at run time
are returned, never written back into the config)."""

from __future__ import annotations

import torch

from shoal.config.engine import EngineConfig
from shoal.model.cpu_features import effective_cpu_features


def resolve_device(config: EngineConfig, rank: int = 0) -> torch.device:
    """The device of tensor-parallel rank `rank`: on CUDA, the rank-th GPU from the one named."""
    if config.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(config.device)
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


def resolve_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """auto: bfloat16 where the hardware computes it natively (CUDA; CPUs whose effective features,
    under SHOAL_CPU_ISA, include AVX512-BF16 or AMX), else float32."""
    if config.dtype != "auto":
        return getattr(torch, config.dtype)
    if device.type == "cuda" or effective_cpu_features().native_bf16:
        return torch.bfloat16
    return torch.float32
