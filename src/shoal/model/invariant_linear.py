"""Matrix multiplies whose per-row results do not depend on how many rows are in the batch.

CPU GEMM libraries pick kernels and blocking by problem shape, so row 0 of `x @ W.T` changes in
its last bits when more rows are added. That would make a request's tokens depend on its
neighbours. Here every multiply runs on tiles of exactly `tile_rows` rows (the last tile
zero-padded), so the kernel always sees one shape. A fixed shape is not enough by itself: MKL's
sgemm (ATen's float32 matmul) splits a tile's rows over threads and gives the rows at the end of a
split to other kernels, so a row's bits depend on its place in the tile (seen with AVX2 on 2
threads, and with AVX-512 on 12 or 16, for SmolLM2's shapes). oneDNN's inner-product kernels compute
every row of a tile alike (checked at every row place, 1 to 16 threads, AVX2 to AMX), so on CPU the
tiles go to oneDNN: prepacked once for the tile height (private copies of the weights), or, without
prepacking, on the shared memory-mapped weights as they are.

oneDNN multiplies bfloat16/float16 where the CPU has its kernels for them (`CpuFeatures.onednn_bf16`
/ `onednn_fp16`, and torch's own check, which follows oneDNN's capped ISA); elsewhere prepacked
16-bit weights are widened to float32 once (exactly), each tile is widened on the way in and
rounded back on the way out, and unprepacked ones use ATen's kernels.
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

    Invariant: with tile_rows > 0 on a CPU with oneDNN, output row i depends only on input row i and
    the weights. tile_rows == 0 turns invariance off (one plain GEMM per call). The output has the
    weights' dtype. `features` is the CPU whose kernels may be used (default: this process's).
    `backend` says what runs: "onednn-packed" (in `compute_dtype`), "onednn" (on the shared weights) or
    "aten".
    """

    def __init__(
        self,
        weights: list[torch.Tensor],
        biases: list[torch.Tensor | None] | None,
        tile_rows: int,
        prepack: bool,
        features: CpuFeatures | None = None,
    ):
        biases = biases or [None] * len(weights)
        self.tile_rows = tile_rows
        self.out_features = sum(w.shape[0] for w in weights)
        self.bias = (
            None
            if all(b is None for b in biases)
            else torch.cat([b if b is not None else w.new_zeros(w.shape[0]) for w, b in zip(weights, biases)])
        )
        on_cpu = tile_rows > 0 and weights[0].device.type == "cpu"
        compute = onednn_compute_dtype(weights[0].dtype, features or effective_cpu_features()) if on_cpu else None
        self.compute_dtype = compute or weights[0].dtype
        if compute is not None and prepack:
            self.backend = "onednn-packed"
            weight = torch.cat(weights) if len(weights) > 1 else weights[0]
            self.bias = None if self.bias is None else self.bias.to(compute)
            self.weights = [torch.ops.mkldnn._reorder_linear_weight(weight.to(compute), tile_rows)]
        else:
            self.backend = "onednn" if compute == weights[0].dtype else "aten"
            self.weights = weights

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_rows == 0:
            return self._multiply(x)
        rows, tile = x.shape[0], self.tile_rows
        padded = -(-rows // tile) * tile
        if padded != rows:
            x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
        if padded == tile:
            return self._multiply(x)[:rows]
        return torch.cat([self._multiply(x[start : start + tile]) for start in range(0, padded, tile)])[:rows]

    def _multiply(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "onednn-packed":
            wide = x.to(self.compute_dtype)
            return torch.ops.mkldnn._linear_pointwise(wide, self.weights[0], self.bias, "none", [], "").to(x.dtype)
        if self.backend == "onednn":
            parts = [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in self.weights]
        elif len(self.weights) == 1:
            return torch.nn.functional.linear(x, self.weights[0], self.bias)
        else:
            parts = [x @ w.t() for w in self.weights]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return out + self.bias if self.bias is not None else out


@functools.cache
def onednn_compute_dtype(dtype: torch.dtype, features: CpuFeatures) -> torch.dtype | None:
    """The dtype oneDNN multiplies `dtype` weights in on `features`: `dtype` itself where oneDNN has
    kernels for it (float32 always), float32 for 16-bit weights elsewhere, None without oneDNN.
    Logged once per dtype and CPU when 16-bit weights fall back."""
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return None
    native = {
        torch.float32: True,
        torch.bfloat16: features.onednn_bf16 and torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        torch.float16: features.onednn_fp16 and torch.ops.mkldnn._is_mkldnn_fp16_supported(),
    }[dtype]
    if not native:
        log.info(
            "%s weights on CPU level %s: oneDNN has no kernels for them here; prepacked ones are multiplied in float32",
            dtype,
            features.describe(),
        )
    return dtype if native else torch.float32
