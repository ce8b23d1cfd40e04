"""Matrix multiplies give each row the same bits whatever the batch around it: the native kernel for
every row count and weight format, and the tiled torch backends on every CPU level."""

from __future__ import annotations

import pytest
import torch

from shoal.model.cpu_features import resolve_cpu_features
from shoal.model.invariant_linear import InvariantLinear, default_tile_rows, onednn_runs
from tests.support.cpu_flags import HASWELL, SAPPHIRE_RAPIDS, ZEN4
from tests.support.linear_rows_check import K_QUANTS, SMALL_BLOCKS, TOLERANCE, check, quantized

CPUS = {"sapphire_rapids": SAPPHIRE_RAPIDS, "zen4": ZEN4, "haswell": HASWELL}


@pytest.mark.parametrize("in_features,out_features", [(576, 200), (64, 17)])
def test_native_rows_are_the_same_bits_for_every_row_count_and_place(in_features, out_features):
    report = check(in_features, out_features)
    assert {name: result["differing"] for name, result in report.items()} == {name: [] for name in TOLERANCE}
    for name, result in report.items():
        assert result["relative_error"] < TOLERANCE[name], name


@pytest.mark.parametrize("kind", SMALL_BLOCKS + K_QUANTS + ("f16", "bf16"))
def test_each_quantized_kind_multiplies_as_ggufs_dequantization(kind):
    """Rows of the identity times the packed blocks give back their values: within 1e-6 (relative to
    the largest) of what gguf dequantizes the same blocks to."""
    columns = 512
    weight = quantized(torch.randn(48, columns), kind)
    linear = InvariantLinear([weight], None, 16, True)
    assert linear.backend == "native" and linear.packed.sources() == [kind]
    expected = weight.dequantize()
    # BF16 weights run against bfloat16 rows (of the identity: exact).
    got = linear(torch.eye(columns, dtype=torch.bfloat16 if kind == "bf16" else torch.float32)).T.float()
    assert (got - expected).abs().max().item() <= 1e-6 * expected.abs().max().item()


def test_native_rows_do_not_depend_on_the_thread_count():
    torch.manual_seed(1)
    linear = InvariantLinear([quantized(torch.randn(300, 576), "q4_1")], None, 16, True)
    x = torch.randn(33, 576)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append(linear(x))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_quantized_weights_stay_quantized_in_the_packed_copy():
    weight = quantized(torch.randn(256, 576), "q4_1")
    linear = InvariantLinear([weight], None, 16, True)
    assert linear.packed.sources() == ["q4_1"] and linear.packed.out_features() == 256
    assert linear.packed.packed_bytes() == weight.blocks.numel()


def assert_rows_do_not_depend_on_batch(linear: InvariantLinear, in_features: int, dtype: torch.dtype) -> None:
    x = torch.randn(1, in_features).to(dtype)
    alone = linear(x)[0]
    tile = linear.tile_rows
    for rows in (2, 3, tile - 1, tile, tile + 1, 3 * tile + 5, 200):
        batch = torch.randn(rows, in_features).to(dtype)
        where = rows // 2
        batch[where] = x[0]
        assert torch.equal(linear(batch)[where], alone), rows


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("in_features,out_features", [(576, 1536), (1536, 576), (64, 128)])
def test_tiled_row_results_do_not_depend_on_batch(dtype, in_features, out_features):
    torch.manual_seed(0)
    weights = [torch.randn(out_features, in_features).to(dtype), torch.randn(64, in_features).to(dtype)]
    biases = [torch.randn(out_features).to(dtype), None]
    linear = InvariantLinear(weights, biases, default_tile_rows(dtype), prepack=False)
    assert linear.backend in ("onednn", "aten")
    assert_rows_do_not_depend_on_batch(linear, in_features, dtype)


ONEDNN_KERNELS = {("sapphire_rapids", torch.bfloat16), ("sapphire_rapids", torch.float16), ("zen4", torch.bfloat16)}


@pytest.mark.parametrize("cpu", CPUS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_shared_16_bit_weights_use_onednn_only_where_cpu_and_torch_both_have_kernels(cpu, dtype):
    """torch's check follows oneDNN's capped ISA, not the CPU; ATen is the fallback."""
    torch_allows = {
        torch.bfloat16: torch.ops.mkldnn._is_mkldnn_bf16_supported(),
        torch.float16: torch.ops.mkldnn._is_mkldnn_fp16_supported(),
    }.get(dtype, True)
    native = dtype == torch.float32 or ((cpu, dtype) in ONEDNN_KERNELS and torch_allows)
    features = resolve_cpu_features(CPUS[cpu], None)
    assert onednn_runs(dtype, features) == native
    weight = torch.randn(64, 64).to(dtype)
    assert InvariantLinear([weight], None, 16, False, features).backend == ("onednn" if native else "aten")


@pytest.mark.parametrize("threads", [2, 6, 12])
@pytest.mark.parametrize("in_features,out_features", [(576, 64), (576, 576), (1536, 576)])
def test_shared_float32_rows_do_not_depend_on_their_place_in_the_tile_at_any_thread_count(
    threads, in_features, out_features
):
    """The thread counts at which MKL's sgemm gives a tile's last rows other bits (AVX2 and AVX-512)."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        torch.manual_seed(0)
        linear = InvariantLinear([torch.randn(out_features, in_features)], None, 16, prepack=False)
        assert linear.backend == "onednn"
        x = torch.randn(1, in_features)
        alone = linear(x)[0]
        for where in range(16):
            tile = torch.randn(16, in_features)
            tile[where] = x[0]
            assert torch.equal(linear(tile)[where], alone), where
    finally:
        torch.set_num_threads(before)


def test_a_gguf_f16_matrix_kept_as_it_is_gives_the_bits_of_its_widened_values():
    """A GGUF's F16 matrices stay 16-bit in the packed copy (half the bytes of float32) and multiply
    float32 rows to the same bits as their values widened to float32."""
    weight = quantized(torch.randn(100, 576), "f16")
    kept = InvariantLinear([weight], None, 16, True)
    widened = InvariantLinear([weight.dequantize()], None, 16, True)
    assert kept.packed.sources() == ["f16"] and kept.packed.packed_bytes() * 2 == widened.packed.packed_bytes()
    x = torch.randn(37, 576)
    assert torch.equal(kept(x), widened(x))


def test_bf16_weights_refuse_float32_rows_with_an_error_not_a_crash():
    linear = InvariantLinear([torch.randn(32, 64).bfloat16()], None, 16, True)
    with pytest.raises(RuntimeError, match="bf16 weights multiply bfloat16 rows only"):
        linear(torch.randn(2, 64))


@pytest.mark.parametrize("kind", SMALL_BLOCKS + K_QUANTS + ("f16", "bf16"))
def test_the_memory_a_packed_kind_takes_is_what_the_fit_check_counts(kind):
    from shoal.model.quantized_weight import PACKED_BYTES_PER_WEIGHT

    linear = InvariantLinear([quantized(torch.randn(64, 512), kind)], None, 16, True)
    assert linear.packed.packed_bytes() == 64 * 512 * PACKED_BYTES_PER_WEIGHT[kind]
