"""Matrix multiplies whose per-row results do not depend on how many rows are in the batch.

CPU GEMM libraries pick kernels and blocking by problem shape, so row 0 of `x @ W.T` changes in
its last bits when more rows are added. That would make a request's tokens depend on its
neighbours. Here every multiply is done on tiles of exactly `tile_rows` rows (the last tile
zero-padded); the kernel then always sees the same shape and each row's result depends on that row
alone. Verified on MKL (float32) and oneDNN (bfloat16); the cost is measured in docs/performance.md.
"""
from __future__ import annotations

import torch


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tile_rows: int) -> torch.Tensor:
    """`x @ weight.T + bias` for x of shape [T, K]; tile_rows == 0 falls back to one plain GEMM."""
    if tile_rows == 0:
        return torch.nn.functional.linear(x, weight, bias)
    rows = x.shape[0]
    padded = -(-rows // tile_rows) * tile_rows
    if padded != rows:
        x = torch.cat([x, x.new_zeros(padded - rows, x.shape[1])])
    out = x.new_empty(padded, weight.shape[0])
    weight_t = weight.t()
    for start in range(0, padded, tile_rows):
        torch.mm(x[start:start + tile_rows], weight_t, out=out[start:start + tile_rows])
    out = out[:rows]
    return out + bias if bias is not None else out


def default_tile_rows(dtype: torch.dtype) -> int:
    """Tile height that costs least at batch 1 while staying fast for large batches (measured)."""
    return 16 if dtype == torch.float32 else 32
