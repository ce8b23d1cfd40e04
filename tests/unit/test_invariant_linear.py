"""Tiled matrix multiplies give each row the same bits whatever the batch around it, on every CPU level."""
from __future__ import annotations

import pytest
import torch

from shoal.model.cpu_features import resolve_cpu_features
from shoal.model.invariant_linear import InvariantLinear, cpu_gemm_backend, default_tile_rows
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
def test_backend_follows_the_cpu_and_torchs_own_check(cpu, dtype):
    """oneDNN only where the CPU has its kernels for the dtype and torch (whose check follows oneDNN's
    capped ISA, not the CPU) agrees; MKL in float32 everywhere else."""
    torch_allows = {torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported()}.get(dtype, False)
    expected = "onednn" if (cpu, dtype) in ONEDNN_KERNELS and torch_allows else "mkl"
    assert cpu_gemm_backend(dtype, resolve_cpu_features(CPUS[cpu], None)) == expected


@pytest.mark.parametrize("cpu,dtype", [("zen4", torch.float16), ("haswell", torch.bfloat16), ("haswell", torch.float16)])
@pytest.mark.parametrize("in_features,out_features", [(576, 1536), (64, 128)])
def test_16_bit_weights_without_onednn_kernels_stay_invariant_in_float32(cpu, dtype, in_features, out_features):
    torch.manual_seed(0)
    weight, bias = torch.randn(out_features, in_features).to(dtype), torch.randn(out_features).to(dtype)
    linear = InvariantLinear([weight], [bias], default_tile_rows(dtype), True, resolve_cpu_features(CPUS[cpu], None))
    assert linear.backend == "mkl"
    assert_rows_do_not_depend_on_batch(linear, in_features, dtype)
    x = torch.randn(40, in_features).to(dtype)
    out = linear(x)
    assert out.dtype == dtype
    torch.testing.assert_close(out, torch.nn.functional.linear(x.float(), weight.float(), bias.float()).to(dtype))
