"""The row-wise paged attention kernel for CPUs (csrc/paged_attention_cpu.cpp).

It is compiled on first use with the machine's own instruction set and cached under
`<shoal cache>/extensions/<hash of source and CPU flags>`, so a different CPU or a changed source
gets its own build. Where no compiler is available the model uses the tiled torch kernel instead.
"""
from __future__ import annotations

import functools
import hashlib
import logging
from pathlib import Path
from types import ModuleType

import torch

from shoal.model.paged_attention import AttentionMetadata
from shoal.model.weight_cache import default_cache_dir

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


@functools.cache
def load_cpu_attention() -> ModuleType | None:
    """The compiled kernel module, or None if it cannot be built here (cached per process: a
    compiled extension can be loaded into a process only once anyway)."""
    from torch.utils import cpp_extension

    digest = hashlib.sha256(SOURCE.read_bytes() + _cpu_flags().encode() + torch.__version__.encode()).hexdigest()[:16]
    build_dir = default_cache_dir() / "extensions" / digest
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        return cpp_extension.load(name="shoal_paged_attention_cpu", sources=[str(SOURCE)], build_directory=str(build_dir),
                                  extra_cflags=["-O3", "-march=native"], verbose=False)
    except Exception as exc:  # no compiler, no headers, read-only cache: fall back to the torch kernel
        log.warning("CPU attention kernel unavailable (%s); using the tiled torch kernel", exc)
        return None


def row_paged_attention(kernel: ModuleType, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                        meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Same contract as `tiled_paged_attention`: q [T, H, D] rotated; returns [T, H * D] in q's dtype."""
    k_cache, v_cache = cache
    out = kernel.paged_attention_rows(q.float().contiguous(), k_cache, v_cache, meta.block_tables,
                                      meta.token_sequences, meta.token_positions, scale)
    return out.view(q.shape[0], -1).to(q.dtype)
