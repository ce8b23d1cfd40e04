"""Matrix multiplies whose per-row results do not depend on how many rows are in the batch.

CPU GEMM libraries pick kernels and blocking by problem shape, so row 0 of `x @ W.T` changes in
its last bits when more rows are added. That would make a request's tokens depend on its
neighbours. Here every multiply runs on tiles of exactly `tile_rows` rows (the last tile
zero-padded): the kernel always sees one shape, and each row's result depends on that row alone.

On CPU the weights can be prepacked once for that fixed tile height, which is both faster and, being
a fixed kernel, just as invariant: oneDNN for bfloat16/float16 where the CPU runs oneDNN's kernels of
that dtype (`CpuFeatures.onednn_bf16` / `onednn_fp16`, and torch's own check, which follows oneDNN's
capped ISA), else MKL in float32, the 16-bit weights widened once (exactly) and each tile widened on
the way in and rounded back on the way out. Prepacked weights are private copies; without prepacking
the weights stay shared memory-mapped pages.
"""
from __future__ import annotations

import functools
import logging

import torch

from shoal.model.cpu_features import CpuFeatures, effective_cpu_features

log = logging.getLogger(__name__)


def default_tile_rows(dtype: torch.dtype) -> int:
    """Tile height, chosen by measurement on SmolLM2 (docs/performance.md): for 16-bit weights a
    32-row tile costs ~20% more than 16 rows at batch 1 but saves a second pass over the weights
    from batch 17 to 32; float32 multiplies are compute-heavier, so they keep 16-row tiles."""
    return 16 if dtype == torch.float32 else 32


class InvariantLinear:
    """`x @ W.T + b` for x [T, K], where W is the row-wise concatenation of `weights` (fused projections).

    Invariant: with tile_rows > 0, output row i depends only on input row i and the weights.
    tile_rows == 0 turns invariance off (one plain GEMM per call). The output has the weights' dtype.
    `features` is the CPU whose kernels prepacking may use (default: this process's effective features).
    """

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None] | None, tile_rows: int,
                 prepack: bool, features: CpuFeatures | None = None):
        biases = biases or [None] * len(weights)
        self.tile_rows = tile_rows
        self.out_features = sum(w.shape[0] for w in weights)
        self.bias = None if all(b is None for b in biases) else torch.cat(
            [b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
        on_cpu = prepack and tile_rows > 0 and weights[0].device.type == "cpu"
        self.backend = cpu_gemm_backend(weights[0].dtype, features or effective_cpu_features()) if on_cpu else "plain"
        if self.backend == "plain":
            self.weights = weights
            return
        weight = torch.cat(weights) if len(weights) > 1 else weights[0]
        if self.backend == "onednn":
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, tile_rows)
        else:
            self.weights = [weight.float()]
            self.bias = None if self.bias is None else self.bias.float()
            self.packed = torch.ops.mkl._mkl_reorder_linear_weight(self.weights[0], tile_rows)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_rows == 0:
            return self._multiply(x)
        rows, tile = x.shape[0], self.tile_rows
        padded = -(-rows // tile) * tile
        if padded != rows:
            x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
        if padded == tile:
            return self._multiply(x)[:rows]
        return torch.cat([self._multiply(x[start:start + tile]) for start in range(0, padded, tile)])[:rows]

    def _multiply(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        if self.backend == "mkl":
            wide = torch.ops.mkl._mkl_linear(x.float(), self.packed, self.weights[0], self.bias, self.tile_rows)
            return wide.to(x.dtype)
        if len(self.weights) == 1:
            return torch.nn.functional.linear(x, self.weights[0], self.bias)
        out = torch.cat([x @ w.t() for w in self.weights], dim=1)
        return out + self.bias if self.bias is not None else out


@functools.cache
def cpu_gemm_backend(dtype: torch.dtype, features: CpuFeatures) -> str:
    """The prepacked kernel for `dtype` weights on `features`: "onednn" (16-bit, where oneDNN runs that
    dtype), "mkl" (float32, and 16-bit weights widened to float32 elsewhere), or "plain" (neither
    library present). Logged once per dtype and CPU."""
    onednn = torch.backends.mkldnn.is_available() and (
        (dtype == torch.bfloat16 and features.onednn_bf16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())
        or (dtype == torch.float16 and features.onednn_fp16 and torch.ops.mkldnn._is_mkldnn_fp16_supported()))
    backend = "onednn" if onednn else "mkl" if torch.backends.mkl.is_available() else "plain"
    if dtype != torch.float32 and backend != "onednn":
        log.info("%s weights on CPU level %s: no oneDNN kernels for them, so %s", dtype, features.describe(),
                 "widened to float32 for MKL" if backend == "mkl" else "multiplied by ATen's generic kernels")
    return backend
