"""Refusing a model that cannot fit before any of it is loaded: its weights at their least (from the
file headers, shoal.model.inspection) and the configured KV cache against the device's free memory."""

from __future__ import annotations

import torch

from shoal.model.inspection import inspect_model
from shoal.runner.memory import free_memory_bytes
from shoal.sizes import UNITS

GIB = UNITS["GIB"]


def check_fits(model: str, dtype: torch.dtype, keep_quantized: bool, kv_cache_bytes: int, device: torch.device) -> None:
    """Raises MemoryError with the figures when the weights (at least what they take loaded) and a
    fixed KV budget (`kv_cache_bytes`; 0 when it is a fraction of what is free) exceed the free memory.
    A lower bound: a model that passes may still need more (packed copies, activations)."""
    report = inspect_model(model, with_config=False)
    weights = report.weight_bytes_in_memory(dtype.itemsize, keep_quantized)
    free = free_memory_bytes(device)
    if weights + kv_cache_bytes > free:
        cache = f" and {kv_cache_bytes / GIB:.2f} GiB of KV cache" if kv_cache_bytes else ""
        raise MemoryError(
            f"{model} does not fit: its weights take at least {weights / GIB:.2f} GiB in {dtype}{cache}, "
            f"and {device} has {free / GIB:.2f} GiB free"
        )
