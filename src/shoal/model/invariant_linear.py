"""Matrix multiplies whose per-row results do not depend on how many rows are in the batch.

CPU GEMM libraries pick kernels and blocking by problem shape, so row 0 of `x @ W.T` changes in
its last bits when more rows are added. That would make a request's tokens depend on its
neighbours. Three backends keep each row's bits its own:

- "native": shoal's C++ kernel (csrc/linear_cpu.cpp) on a private copy of the weights packed for
  it. Every output element is one fixed-order reduction over K by one thread, for every row count,
  so nothing is padded. It runs float32, bfloat16 and float16 weights and GGUF-quantized blocks
  (which stay quantized). The default on CPUs with AVX2 or more wherever the kernels build.
- "onednn": oneDNN's inner-product kernels on the shared memory-mapped weights as they are, on
  tiles of exactly `tile_rows` rows (the last zero-padded), so the kernel always sees one shape;
  oneDNN computes every row of a tile alike (checked at every row place, 1 to 16 threads, AVX2 to
  AMX). Used when the weights stay shared (no private copy) and oneDNN has kernels for their dtype.
- "aten": torch's own kernels on the same tiles: CUDA (the path written for it), and shared 16-bit
  weights on CPUs where oneDNN has no kernels for them (ATen's bfloat16/float16 CPU kernels, which
  tests/unit/test_invariant_linear.py checks row by row). Shared float32 weights never take it on
  CPU: MKL's sgemm gives a tile's last rows other kernels on some thread counts.
"""

from __future__ import annotations

import functools
import logging

import torch

from shoal.model.cpu_features import CpuFeatures, effective_cpu_features
from shoal.model.native_kernels import load_native_kernels
from shoal.model.quantized_weight import QuantizedWeight

log = logging.getLogger(__name__)

Weight = torch.Tensor | QuantizedWeight

NATIVE_FORMATS = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def default_tile_rows(dtype: torch.dtype) -> int:
    """Tile height of the tiled backends, chosen by measurement on SmolLM2 (docs/performance.md): for
    16-bit weights a 32-row tile costs ~20% more than 16 rows at batch 1 but saves a second pass over
    the weights from batch 17 to 32; float32 multiplies are compute-heavier, so they keep 16-row tiles."""
    return 16 if dtype == torch.float32 else 32


class InvariantLinear:
    """`x @ W.T + b` for x [T, K], where W is the row-wise concatenation of `weights` (fused projections).

    Invariant: on the native backend, and with tile_rows > 0 on the tiled ones, output row i depends
    only on input row i and the weights; tile_rows == 0 turns the tiles off (one plain GEMM per call).
    The output has x's dtype, which is the float weights' dtype (quantized weights take float32 or
    16-bit x). `prepack` allows a private packed copy of the weights (the native backend); without
    it the weights are used where they lie (shared pages). `features` is the CPU whose kernels may be
    used (default: this process's).
    """

    def __init__(
        self,
        weights: list[Weight],
        biases: list[torch.Tensor | None] | None,
        tile_rows: int,
        prepack: bool,
        features: CpuFeatures | None = None,
    ):
        biases = biases or [None] * len(weights)
        self.tile_rows = tile_rows
        self.out_features = sum(w.shape[0] for w in weights)
        float_bias = [
            b.float() if b is not None else torch.zeros(w.shape[0], device=w.device) for w, b in zip(weights, biases)
        ]
        has_bias = any(b is not None for b in biases)
        native = prepack and weights[0].device.type == "cpu" and load_native_kernels() is not None
        quantized = any(isinstance(w, QuantizedWeight) for w in weights)
        if quantized and not native:
            raise ValueError("quantized weights need shoal's CPU matrix multiply (a CPU with AVX2, a C++ compiler)")
        if native and (quantized or weights[0].dtype in NATIVE_FORMATS):
            self.backend = "native"
            runs = _same_format_runs(weights)
            self.packed = torch.classes.shoal.PackedLinear(
                [_kernel_input(_concatenated(run)) for run in runs],
                [_format(run[0]) for run in runs],
                weights[0].shape[1],
                torch.cat(float_bias) if has_bias else None,
            )
            return
        self.weights = weights
        self.bias = torch.cat(float_bias).to(weights[0].dtype) if has_bias else None
        on_cpu = weights[0].device.type == "cpu"
        onednn = on_cpu and onednn_runs(weights[0].dtype, features or effective_cpu_features())
        self.backend = "onednn" if onednn else "aten"

    @property
    def description(self) -> str:
        """The backend and the weight formats it runs, e.g. "native q4_1" or "onednn bfloat16"."""
        if self.backend == "native":
            return "native " + "+".join(dict.fromkeys(self.packed.sources()))
        return f"{self.backend} {str(self.weights[0].dtype).removeprefix('torch.')}"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "native":
            return self._native(x)
        if self.tile_rows == 0:
            return self._tiled(x)
        rows, tile = x.shape[0], self.tile_rows
        padded = -(-rows // tile) * tile
        if padded != rows:
            x = torch.nn.functional.pad(x, (0, 0, 0, padded - rows))
        if padded == tile:
            return self._tiled(x)[:rows]
        return torch.cat([self._tiled(x[start : start + tile]) for start in range(0, padded, tile)])[:rows]

    def _native(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.forward(x)

    def _tiled(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "onednn":
            parts = [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "") for w in self.weights]
        elif len(self.weights) == 1:
            return torch.nn.functional.linear(x, self.weights[0], self.bias)
        else:
            parts = [x @ w.t() for w in self.weights]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return out + self.bias if self.bias is not None else out


def _format(weight: Weight) -> str:
    return weight.kind if isinstance(weight, QuantizedWeight) else NATIVE_FORMATS.get(weight.dtype, str(weight.dtype))


def _same_format_runs(weights: list[Weight]) -> list[list[Weight]]:
    """Consecutive weights of one format, which are packed as one matrix."""
    runs: list[list[Weight]] = []
    for weight in weights:
        if runs and _format(runs[-1][-1]) == _format(weight):
            runs[-1].append(weight)
        else:
            runs.append([weight])
    return runs


def _concatenated(weights: list[Weight]) -> Weight:
    if len(weights) == 1:
        return weights[0]
    if isinstance(weights[0], QuantizedWeight):
        return QuantizedWeight(torch.cat([w.blocks for w in weights]), weights[0].kind, weights[0].columns)
    return torch.cat(weights)


def _kernel_input(weight: Weight) -> torch.Tensor:
    """What PackedLinear packs: the float matrix, or the rows of GGML blocks."""
    return weight.kernel_input() if isinstance(weight, QuantizedWeight) else weight.contiguous()


@functools.cache
def onednn_runs(dtype: torch.dtype, features: CpuFeatures) -> bool:
    """Whether oneDNN multiplies `dtype` weights on `features` with kernels of its own: float32
    always (where torch has oneDNN), 16-bit dtypes only where the CPU has them (`CpuFeatures.onednn_bf16`
    / `onednn_fp16`, and torch's own check, which follows oneDNN's capped ISA). Logged once per
    dtype and CPU when 16-bit weights fall back to ATen."""
    if not torch.backends.mkldnn.is_available() or dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    native = {
        torch.float32: True,
        torch.bfloat16: features.onednn_bf16 and torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        torch.float16: features.onednn_fp16 and torch.ops.mkldnn._is_mkldnn_fp16_supported(),
    }[dtype]
    if not native:
        log.info(
            "%s weights on CPU level %s: oneDNN has no kernels for them here; ATen multiplies them",
            dtype,
            features.describe(),
        )
    return native
