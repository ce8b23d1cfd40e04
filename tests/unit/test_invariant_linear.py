"""Tiled matrix multiplies give each row the same bits whatever the batch around it, on every CPU level."""

from __future__ import annotations

import pytest
import torch

from shoal.model.cpu_features import resolve_cpu_features
from shoal.model.invariant_linear import (
    InvariantLinear,
    default_tile_rows,
    onednn_compute_dtype,
)
from tests.support.cpu_flags import HASWELL, SAPPHIRE_RAPIDS, ZEN4

CPUS = {"sapphire_rapids": SAPPHIRE_RAPIDS, "zen4": ZEN4, "haswell": HASWELL}


def assert_rows_do_not_depend_on_batch(linear: InvariantLinear, in_features: int, dtype: torch.dtype) -> None:
    x = torch.randn(1, in_features).to(dtype)
    alone = linear(x)[0]
    tile = linear.tile_rows
    for rows in (2, 3, tile - 1, tile, tile + 1, 3 * tile + 5, 200):
        batch = torch.randn(rows, in_features).to(dtype)
        where = rows // 2
        batch[where] = x[0]
        assert torch.equal(linear(batch)[where], alone), rows


@pytest.mark.parametrize("prepack", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_features,out_features", [(576, 1536), (1536, 576), (64, 128), (576, 4096)])
def test_row_results_do_not_depend_on_batch(dtype, in_features, out_features, prepack):
    torch.manual_seed(0)
    weights = [torch.randn(out_features, in_features).to(dtype), torch.randn(64, in_features).to(dtype)]
    biases = [torch.randn(out_features).to(dtype), None]
    linear = InvariantLinear(weights, biases, default_tile_rows(dtype), prepack)
    assert_rows_do_not_depend_on_batch(linear, in_features, dtype)


ONEDNN_KERNELS = {("sapphire_rapids", torch.bfloat16), ("sapphire_rapids", torch.float16), ("zen4", torch.bfloat16)}


@pytest.mark.parametrize("cpu", CPUS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_16_bit_weights_use_onednn_kernels_only_where_cpu_and_torch_both_have_them(cpu, dtype):
    """torch's check follows oneDNN's capped ISA, not the CPU; float32 is the fallback everywhere."""
    torch_allows = {
        torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported(),
    }.get(dtype, True)
    native = dtype == torch.float32 or ((cpu, dtype) in ONEDNN_KERNELS and torch_allows)
    assert onednn_compute_dtype(dtype, resolve_cpu_features(CPUS[cpu], None)) == (dtype if native else torch.float32)


@pytest.mark.parametrize(
    "cpu,dtype", [("zen4", torch.float16), ("haswell", torch.bfloat16), ("haswell", torch.float16)]
)
@pytest.mark.parametrize("in_features,out_features", [(576, 1536), (64, 128)])
def test_16_bit_weights_without_onednn_kernels_stay_invariant_in_float32(cpu, dtype, in_features, out_features):
    torch.manual_seed(0)
    weight, bias = torch.randn(out_features, in_features).to(dtype), torch.randn(out_features).to(dtype)
    features = resolve_cpu_features(CPUS[cpu], None)
    linear = InvariantLinear([weight], [bias], default_tile_rows(dtype), True, features)
    assert (linear.backend, linear.compute_dtype) == ("onednn-packed", torch.float32)
    assert_rows_do_not_depend_on_batch(linear, in_features, dtype)
    x = torch.randn(40, in_features).to(dtype)
    out = linear(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, torch.nn.functional.linear(x.float(), weight.float(), bias.float()).to(dtype))
    assert InvariantLinear([weight], [bias], default_tile_rows(dtype), False, features).backend == "aten"


@pytest.mark.parametrize("threads", [2, 6, 12])
@pytest.mark.parametrize("prepack", [False, True])
@pytest.mark.parametrize("in_features,out_features", [(576, 64), (576, 576), (1536, 576)])
def test_float32_rows_do_not_depend_on_their_place_in_the_tile_at_any_thread_count(
    threads, prepack, in_features, out_features
):
    """The thread counts at which MKL's sgemm gives a tile's last rows other bits (AVX2 and AVX-512)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        linear = InvariantLinear([torch.randn(out_features, in_features)], None, 16, prepack)
        assert linear.backend == ("onednn-packed" if prepack else "onednn")
        x = torch.randn(1, in_features)
        alone = linear(x)[0]
        for where in range(16):
            tile = torch.randn(16, in_features)
            tile[where] = x[0]
            assert torch.equal(linear(tile)[where], alone), where
    finally:
        torch.set_num_threads(before)
