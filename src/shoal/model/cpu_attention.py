"""The row-wise paged attention kernel for CPUs (csrc/paged_attention_cpu.cpp, the operator
`torch.ops.shoal.paged_attention_rows` of the library native_kernels builds)."""

from __future__ import annotations

from types import ModuleType

import torch

from shoal.model.paged_attention import AttentionMetadata


def row_paged_attention(
    kernel: ModuleType,
    q: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `tiled_paged_attention`: q [T, H, D] rotated; returns [T, H * D] in q's dtype."""
    k_cache, v_cache = cache
    out = kernel.paged_attention_rows(
        q.float().contiguous(),
        k_cache,
        v_cache,
        meta.block_tables,
        meta.token_sequences,
        meta.token_positions,
        scale,
        window,
        softcap,
        torch.empty(0) if sinks is None else sinks.float().contiguous(),
    )
    return out.view(q.shape[0], -1).to(q.dtype)
