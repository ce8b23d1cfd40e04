"""GGUF -> LlamaConfig + HF-named state dict: dequantization per ggml type, dimension order, q/k un-permutation."""

from __future__ import annotations

import math
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from shoal.model.config import RopeScaling
from shoal.model.errors import ModelLoadError
from shoal.model.gguf_loader import (
    dequantize_tensor,
    gguf_config,
    gguf_state_dict,
    load_gguf,
    open_gguf,
    quantized_tensor,
    tensor_rows,
)
from shoal.model.quantized_weight import QuantizedWeight
from shoal.model.registry import resolve_model
from shoal.model.rope import inverse_frequencies
from tests.support.gguf_models import (
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTER,
    KV_HEADS,
    LAYERS,
    gguf_name,
    llama_cpp_permute,
    random_hf_weights,
)

PERMUTED = ("llama", "granite", "smollm3")  # llama.cpp's converter permutes their q/k rows


def write_model_gguf(
    path: Path,
    arch: str,
    weights: dict[str, np.ndarray],
    qtype: Q = Q.F32,
    extra_tensors: dict[str, np.ndarray] | None = None,
    extra_keys: dict[str, float | int] | None = None,
    rope_dim: int = HEAD_DIM,
) -> Path:
    """A GGUF as llama.cpp's converter writes it: q/k rows permuted for llama, 2-D weights in `qtype`."""
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(500000.0)
    w.add_rope_dimension_count(rope_dim)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    for key, value in (extra_keys or {}).items():
        w.add_uint32(key, value) if isinstance(value, int) else w.add_float32(key, value)
    for name, value in weights.items():
        if arch in PERMUTED and ".q_proj." in name:
            value = llama_cpp_permute(value, HEADS)
        elif arch in PERMUTED and ".k_proj." in name:
            value = llama_cpp_permute(value, KV_HEADS)
        if value.ndim == 2 and qtype != Q.F32:
            w.add_tensor(gguf_name(name), gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(gguf_name(name), value)
    for name, value in (extra_tensors or {}).items():
        if value.ndim == 2 and qtype != Q.F32:
            w.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(name, value)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_llama_gguf_undoes_rotary_permutation(tmp_path: Path) -> None:
    original = random_hf_weights(np.random.default_rng(0), bias=False, tied=True)
    config, weights = load_gguf(write_model_gguf(tmp_path / "m.gguf", "llama", original))
    assert (config.architecture, config.num_layers, config.hidden_size) == ("llama", 2, 64)
    assert config.intermediate_size == 96
    assert (config.num_heads, config.num_kv_heads, config.head_dim, config.vocab_size) == (4, 2, 16, 40)
    assert (config.rope_theta, config.rms_norm_eps, config.max_position_embeddings) == (500000.0, 1e-6, 256)
    assert config.tie_word_embeddings and not config.attention_bias
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))
    assert set(weights) == set(original)
    for name, value in original.items():
        assert torch.equal(weights[name], torch.from_numpy(value)), name


def test_qwen2_gguf_keeps_row_order_biases_and_lm_head(tmp_path: Path) -> None:
    original = random_hf_weights(np.random.default_rng(1), bias=True, tied=False)
    config, weights = load_gguf(write_model_gguf(tmp_path / "m.gguf", "qwen2", original))
    assert config.architecture == "qwen2" and config.attention_bias and not config.tie_word_embeddings
    assert set(weights) == set(original) and "lm_head.weight" in weights
    for name, value in original.items():
        assert torch.equal(weights[name], torch.from_numpy(value)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantized_model_loads_in_requested_dtype(tmp_path: Path, dtype: torch.dtype) -> None:
    # Q8_0 blocks run along rows and the permutation moves whole rows, so they commute.
    original = random_hf_weights(np.random.default_rng(2), bias=False, tied=True)
    path = write_model_gguf(tmp_path / "m.gguf", "llama", original, qtype=Q.Q8_0)
    _, weights = load_gguf(path, dtype=dtype)
    for name, value in original.items():
        expected = gguf.quants.dequantize(gguf.quants.quantize(value, Q.Q8_0), Q.Q8_0) if value.ndim == 2 else value
        assert weights[name].dtype == dtype
        assert torch.equal(weights[name], torch.from_numpy(np.ascontiguousarray(expected)).to(dtype)), name


def _single_tensor_file(path: Path, raw: np.ndarray, qtype: Q) -> gguf.gguf_reader.ReaderTensor:
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("t", raw, raw_dtype=None if qtype in (Q.F32, Q.F16) else qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    (tensor,) = open_gguf(path).tensors
    return tensor


@pytest.mark.parametrize(
    "qtype, tolerance", [(Q.F32, 0.0), (Q.F16, 1e-3), (Q.BF16, 8e-3), (Q.Q8_0, 2e-2), (Q.Q4_0, 0.35), (Q.Q4_1, 0.25)]
)
def test_dequantize_per_type(tmp_path: Path, qtype: Q, tolerance: float) -> None:
    values = np.random.default_rng(3).standard_normal((5, 96)).astype(np.float32)  # 3 blocks per row, 5 rows
    raw = values.astype(np.float16) if qtype == Q.F16 else gguf.quants.quantize(values, qtype)
    tensor = _single_tensor_file(tmp_path / "t.gguf", raw, qtype)
    assert list(tensor.shape) == [96, 5]  # ggml order: innermost dimension first
    out = dequantize_tensor(tensor)
    assert out.shape == (5, 96) and out.dtype == np.float32 and out.flags.writeable
    if qtype == Q.BF16:
        expected = torch.from_numpy(values).to(torch.bfloat16).float().numpy()
    elif qtype in (Q.F32, Q.F16):
        expected = raw.astype(np.float32)
    else:
        expected = gguf.quants.dequantize(raw, qtype)
    np.testing.assert_array_equal(out, expected)
    assert np.abs(out - values).max() <= tolerance * np.abs(values).max()


def _q4_k_reference(block: bytes) -> list[float]:
    """ggml's dequantize_row_q4_K for one 256-value block, written out scalar by scalar."""
    d, dmin = np.frombuffer(block[:4], dtype=np.float16).astype(np.float32)
    scales, qs = block[4:16], block[16:144]

    def scale_min(j: int) -> tuple[int, int]:
        if j < 4:
            return scales[j] & 63, scales[j + 4] & 63
        return (scales[j + 4] & 0xF) | ((scales[j - 4] >> 6) << 4), (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4)

    out: list[float] = []
    for chunk in range(4):
        (sc1, m1), (sc2, m2) = scale_min(2 * chunk), scale_min(2 * chunk + 1)
        q = qs[32 * chunk : 32 * chunk + 32]
        out += [float(d * sc1 * (b & 0xF) - dmin * m1) for b in q]
        out += [float(d * sc2 * (b >> 4) - dmin * m2) for b in q]
    return out


def _q6_k_reference(block: bytes) -> list[float]:
    """ggml's dequantize_row_q6_K for one 256-value block."""
    ql, qh = block[:128], block[128:192]
    sc = np.frombuffer(block[192:208], dtype=np.int8).astype(np.float32)
    d = np.frombuffer(block[208:210], dtype=np.float16).astype(np.float32)[0]
    out = [0.0] * 256
    for half in range(2):
        l_off, h_off, s_off, y = 64 * half, 32 * half, 8 * half, 128 * half
        for lane in range(32):
            is_ = lane // 16
            q1 = ((ql[l_off + lane] & 0xF) | (((qh[h_off + lane] >> 0) & 3) << 4)) - 32
            q2 = ((ql[l_off + lane + 32] & 0xF) | (((qh[h_off + lane] >> 2) & 3) << 4)) - 32
            q3 = ((ql[l_off + lane] >> 4) | (((qh[h_off + lane] >> 4) & 3) << 4)) - 32
            q4 = ((ql[l_off + lane + 32] >> 4) | (((qh[h_off + lane] >> 6) & 3) << 4)) - 32
            out[y + lane] = float(d * sc[s_off + is_] * q1)
            out[y + lane + 32] = float(d * sc[s_off + is_ + 2] * q2)
            out[y + lane + 64] = float(d * sc[s_off + is_ + 4] * q3)
            out[y + lane + 96] = float(d * sc[s_off + is_ + 6] * q4)
    return out


def random_k_quant_rows(qtype: Q, rows: int, blocks_per_row: int) -> np.ndarray:
    """Random K-quant blocks with finite fp16 scales (gguf-py cannot quantize to K-quants)."""
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(4)
    raw = rng.integers(0, 256, (rows, blocks_per_row, block_bytes), dtype=np.uint8)
    scale_at = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q2_K: (80, 82), Q.Q3_K: (108,), Q.IQ4_XS: (0,), Q.IQ2_XXS: (0,)}
    scale_at = scale_at.get(qtype, (208,))
    for offset in scale_at:
        scales = rng.uniform(0.01, 0.1, (rows, blocks_per_row, 1)).astype(np.float16)
        raw[:, :, offset : offset + 2] = scales.view(np.uint8)
    return raw.reshape(rows, blocks_per_row * block_bytes)


@pytest.mark.parametrize("qtype, reference", [(Q.Q4_K, _q4_k_reference), (Q.Q6_K, _q6_k_reference)])
def test_dequantize_k_quants_against_ggml_reference(tmp_path: Path, qtype: Q, reference) -> None:
    _, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, blocks_per_row = 3, 2
    raw = random_k_quant_rows(qtype, rows, blocks_per_row)
    out = dequantize_tensor(_single_tensor_file(tmp_path / "t.gguf", raw, qtype))
    assert out.shape == (rows, 256 * blocks_per_row)
    expected = [
        reference(raw[r, b * block_bytes : (b + 1) * block_bytes].tobytes())
        for r in range(rows)
        for b in range(blocks_per_row)
    ]
    np.testing.assert_allclose(out, np.array(expected, dtype=np.float32).reshape(out.shape), rtol=1e-6, atol=1e-6)


def llama_cpp_llama3_rope_factors(base: float, factor: float, low: float, high: float, old_context: int):
    """convert_hf_to_gguf.py's LlamaModel rope_freqs for Llama 3.1-style scaling."""
    factors = []
    for frequency in 1.0 / (base ** (np.arange(0, HEAD_DIM, 2, dtype=np.float32) / HEAD_DIM)):
        wavelength = 2 * math.pi / frequency
        if wavelength < old_context / high:
            factors.append(1.0)
        elif wavelength > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelength - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


def test_rope_freqs_of_a_llama3_gguf_give_llama3_frequencies(tmp_path: Path) -> None:
    weights = random_hf_weights(np.random.default_rng(6), bias=False, tied=True)
    factors = llama_cpp_llama3_rope_factors(500000.0, 8.0, 1.0, 4.0, 256)
    assert len(set(factors.tolist())) > 2, "the shape should have low, high and smoothed frequencies"
    path = write_model_gguf(tmp_path / "m.gguf", "llama", weights, extra_tensors={"rope_freqs.weight": factors})
    config, state = load_gguf(path)
    assert config.rope_scaling.rope_type == "frequency_factors" and "rope_freqs.weight" not in state
    llama3 = RopeScaling("llama3", 8.0, 1.0, 4.0, 256)
    expected = inverse_frequencies(HEAD_DIM, 500000.0, llama3, 256)
    actual = inverse_frequencies(HEAD_DIM, config.rope_theta, config.rope_scaling, 256)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=0)


def test_unsupported_inputs_raise_model_load_error(tmp_path: Path) -> None:
    weights = random_hf_weights(np.random.default_rng(5), bias=False, tied=True)
    with pytest.raises(ModelLoadError, match="architecture 'gemma'"):
        load_gguf(write_model_gguf(tmp_path / "a.gguf", "gemma", weights))
    extra = {"blk.0.attn_q_norm.weight": np.ones(HEAD_DIM, np.float32)}
    with pytest.raises(ModelLoadError, match="unexpected tensors .*q_norm"):
        load_gguf(write_model_gguf(tmp_path / "b.gguf", "llama", weights, extra_tensors=extra))
    rope_freqs = {"rope_freqs.weight": np.ones(HEAD_DIM // 2 + 1, np.float32)}
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        load_gguf(write_model_gguf(tmp_path / "c.gguf", "llama", weights, extra_tensors=rope_freqs))
    del weights["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(ModelLoadError, match="missing tensors"):
        load_gguf(write_model_gguf(tmp_path / "d.gguf", "llama", weights))
    with pytest.raises(ModelLoadError):
        open_gguf(tmp_path / "absent.gguf")


@pytest.fixture(scope="module")
def smollm2_reader() -> gguf.GGUFReader:
    return open_gguf(resolve_model("smollm2-135m-instruct").path)


def test_smollm2_config(smollm2_reader: gguf.GGUFReader) -> None:
    config = gguf_config(smollm2_reader)
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    assert (config.vocab_size, config.head_dim, config.intermediate_size) == (49152, 64, 1536)
    assert config.tie_word_embeddings and not config.attention_bias and config.architecture == "llama"
    assert (config.rope_theta, config.rms_norm_eps, config.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


def test_smollm2_state_dict_matches_transformers_unpermutation(smollm2_reader: gguf.GGUFReader) -> None:
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    config = gguf_config(smollm2_reader)
    weights = gguf_state_dict(smollm2_reader, config, torch.float32)
    assert len(weights) == 2 + 9 * 30 and "lm_head.weight" not in weights
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    tensors = {t.name: t for t in smollm2_reader.tensors}
    for gguf_key, hf_key in [
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
        ("blk.29.attn_k.weight", "model.layers.29.self_attn.k_proj.weight"),
    ]:
        raw = gguf.quants.dequantize(tensors[gguf_key].data, tensors[gguf_key].tensor_type)
        expected = processor.process(raw, gguf_key).weights
        assert torch.equal(weights[hf_key], torch.from_numpy(np.ascontiguousarray(expected)))


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1])
def test_kept_quantized_matrices_hold_the_same_values_as_dequantized_ones(tmp_path: Path, qtype: Q) -> None:
    original = random_hf_weights(np.random.default_rng(3), bias=False, tied=True)
    reader = open_gguf(write_model_gguf(tmp_path / "m.gguf", "llama", original, qtype=qtype))
    config = gguf_config(reader)
    kept = gguf_state_dict(reader, config, keep_quantized=True)
    dequantized = gguf_state_dict(reader, config)
    for name, value in original.items():
        if value.ndim == 2:
            assert isinstance(kept[name], QuantizedWeight) and kept[name].kind == qtype.name.lower(), name
            assert torch.equal(kept[name].dequantize(), dequantized[name]), name  # rows un-permuted alike
        else:
            assert torch.equal(kept[name], dequantized[name]), name


@pytest.mark.parametrize("qtype", [Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_XS])
def test_k_quant_matrices_are_kept_as_their_blocks(tmp_path: Path, qtype: Q) -> None:
    raw = random_k_quant_rows(qtype, rows=3, blocks_per_row=2)
    tensor = _single_tensor_file(tmp_path / "t.gguf", raw, qtype)
    kept = quantized_tensor(tensor)
    assert kept is not None and kept.kind == qtype.name.lower() and kept.shape == (3, 512)
    assert torch.equal(kept.blocks, torch.from_numpy(raw))
    assert torch.equal(kept.dequantize(), torch.from_numpy(dequantize_tensor(tensor)))


def test_a_tensor_type_without_a_native_kernel_is_widened_with_a_log_line(tmp_path: Path, caplog) -> None:
    raw = random_k_quant_rows(Q.IQ2_XXS, rows=3, blocks_per_row=2)
    tensor = _single_tensor_file(tmp_path / "t.gguf", raw, Q.IQ2_XXS)
    with caplog.at_level("WARNING", logger="shoal.model.gguf_loader"):
        rows, kept = tensor_rows(tensor, torch.bfloat16, keep_quantized=True)
    assert kept is None and torch.equal(rows, torch.from_numpy(dequantize_tensor(tensor)))
    assert [r.getMessage() for r in caplog.records] == [
        f"GGUF tensor t: ggml type IQ2_XXS has no native kernel against torch.bfloat16 activations; widened: "
        f"{3 * 512 * 2:,} bytes instead of {raw.nbytes:,}"
    ]


def test_a_qwen3_gguf_loads_its_per_head_query_and_key_norms_unpermuted(tmp_path: Path) -> None:
    rng = np.random.default_rng(8)
    weights = random_hf_weights(rng, bias=False, tied=True)
    norms = {
        f"blk.{i}.attn_{which}_norm.weight": rng.standard_normal(HEAD_DIM).astype(np.float32)
        for i in range(LAYERS)
        for which in "qk"
    }
    config, state = load_gguf(write_model_gguf(tmp_path / "q.gguf", "qwen3", weights, extra_tensors=norms))
    assert config.architecture == "qwen3" and config.qk_norm
    for i in range(LAYERS):
        for which in "qk":
            expected = torch.from_numpy(norms[f"blk.{i}.attn_{which}_norm.weight"])
            assert torch.equal(state[f"model.layers.{i}.self_attn.{which}_norm.weight"], expected)
    name = "model.layers.1.self_attn.q_proj.weight"
    assert torch.equal(state[name], torch.from_numpy(weights[name]))  # qwen files keep HF row order


def test_a_granite_gguf_carries_its_multipliers_and_permuted_rows(tmp_path: Path) -> None:
    weights = random_hf_weights(np.random.default_rng(9), bias=False, tied=True)
    keys = {"granite.embedding_scale": 12.0, "granite.residual_scale": 0.22, "granite.attention.scale": 0.0078125}
    keys["granite.logit_scale"] = 8.0
    config, state = load_gguf(write_model_gguf(tmp_path / "g.gguf", "granite", weights, extra_keys=keys))
    assert (config.architecture, config.embedding_multiplier, config.residual_multiplier) == ("granite", 12.0, 0.22)
    assert (config.attention_multiplier, config.logits_scaling) == (0.0078125, 8.0)
    name = "model.layers.0.self_attn.k_proj.weight"
    assert torch.equal(state[name], torch.from_numpy(weights[name]))  # un-permuted as llama's


def phi3_weights(rng: np.random.Generator) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """Phi-3's tensors as llama.cpp's converter writes them: q/k/v fused into attn_qkv, gate and up
    into ffn_up; the other tensors by their Hugging Face names."""
    weights = random_hf_weights(rng, bias=False, tied=True)
    fused = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        qkv = [weights.pop(f"{p}self_attn.{x}_proj.weight") for x in "qkv"]
        gate_up = [weights.pop(f"{p}mlp.{x}_proj.weight") for x in ("gate", "up")]
        fused[f"blk.{i}.attn_qkv.weight"] = np.concatenate(qkv)
        fused[f"blk.{i}.ffn_up.weight"] = np.concatenate(gate_up)
    return weights, fused


@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0])
def test_a_phi3_gguf_splits_its_fused_projections_blocks_included(tmp_path: Path, qtype) -> None:
    weights, fused = phi3_weights(np.random.default_rng(10))
    reader = open_gguf(write_model_gguf(tmp_path / "p.gguf", "phi3", weights, qtype=qtype, extra_tensors=fused))
    config = gguf_config(reader)
    state = gguf_state_dict(reader, config, torch.float32, keep_quantized=qtype != Q.F32)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        qkv = torch.cat([dense(state[f"{p}self_attn.{x}_proj.weight"]) for x in "qkv"])
        gate_up = torch.cat([dense(state[f"{p}mlp.{x}_proj.weight"]) for x in ("gate", "up")])
        expected = [fused[f"blk.{i}.{n}.weight"] for n in ("attn_qkv", "ffn_up")]
        if qtype != Q.F32:  # the file's blocks, dequantized
            expected = [gguf.quants.dequantize(gguf.quants.quantize(e, qtype), qtype) for e in expected]
        assert torch.equal(qkv, torch.from_numpy(expected[0])) and torch.equal(gate_up, torch.from_numpy(expected[1]))
        assert isinstance(state[f"{p}self_attn.k_proj.weight"], QuantizedWeight) == (qtype != Q.F32)


def dense(weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight


def test_an_olmo2_gguf_has_norms_after_and_over_whole_projections(tmp_path: Path) -> None:
    rng = np.random.default_rng(11)
    weights = random_hf_weights(rng, bias=False, tied=True)
    extra = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        del weights[p + "input_layernorm.weight"], weights[p + "post_attention_layernorm.weight"]
        sizes = {"post_attention_norm": HIDDEN, "post_ffw_norm": HIDDEN, "attn_q_norm": HEADS * HEAD_DIM}
        sizes["attn_k_norm"] = KV_HEADS * HEAD_DIM
        extra.update({f"blk.{i}.{n}.weight": rng.standard_normal(size).astype(np.float32) for n, size in sizes.items()})
    config, state = load_gguf(write_model_gguf(tmp_path / "o.gguf", "olmo2", weights, extra_tensors=extra))
    assert config.norms_after and config.qk_norm == "projection"
    expected = torch.from_numpy(extra["blk.1.post_ffw_norm.weight"])
    assert torch.equal(state["model.layers.1.post_feedforward_layernorm.weight"], expected)
    assert state["model.layers.0.self_attn.q_norm.weight"].shape == (HEADS * HEAD_DIM,)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(state[name], torch.from_numpy(weights[name]))  # not permuted


def test_a_smollm3_gguf_leaves_rope_out_of_every_fourth_layer_as_llama_cpp_does(tmp_path: Path) -> None:
    weights = random_hf_weights(np.random.default_rng(12), bias=False, tied=True)
    config, state = load_gguf(write_model_gguf(tmp_path / "s.gguf", "smollm3", weights))
    assert config.architecture == "smollm3" and config.rotary_layers == (True,) * LAYERS  # 4th: none of 2
    name = "model.layers.1.self_attn.k_proj.weight"
    assert torch.equal(state[name], torch.from_numpy(weights[name]))  # un-permuted as llama's


def gemma_gguf(path: Path, arch: str, rng: np.random.Generator, keys: dict) -> tuple[Path, dict[str, np.ndarray]]:
    """A Gemma file as llama.cpp's converter writes it: four norms a layer (already 1 + w), per-head
    q/k norms for Gemma 3, rows as in Hugging Face's files, tied embeddings."""
    weights = random_hf_weights(rng, bias=False, tied=True)
    extra = {}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        del weights[p + "input_layernorm.weight"], weights[p + "post_attention_layernorm.weight"]
        names = ["attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"]
        extra.update({f"blk.{i}.{n}.weight": rng.standard_normal(HIDDEN).astype(np.float32) for n in names})
        if arch == "gemma3":
            extra.update(
                {f"blk.{i}.attn_{x}_norm.weight": rng.standard_normal(HEAD_DIM).astype(np.float32) for x in "qk"}
            )
    return write_model_gguf(path, arch, weights, extra_tensors=extra, extra_keys=keys), extra


def test_a_gemma2_gguf_has_four_norms_soft_caps_and_alternating_windows(tmp_path: Path) -> None:
    keys = {"gemma2.attention.sliding_window": 5, "gemma2.attn_logit_softcapping": 50.0}
    keys["gemma2.final_logit_softcapping"] = 30.0
    path, extra = gemma_gguf(tmp_path / "g.gguf", "gemma2", np.random.default_rng(13), keys)
    config, state = load_gguf(path)
    assert config.architecture == "gemma2" and config.norms_before and config.norms_after
    assert (config.attention_softcap, config.logit_softcap, config.mlp_activation) == (50.0, 30.0, "gelu_tanh")
    assert config.attention_windows == (5, 0)  # llama.cpp's pattern of two: the first layer windowed
    assert config.embedding_multiplier == pytest.approx(HIDDEN**0.5)
    assert config.attention_scale == pytest.approx(HEAD_DIM**-0.5)  # head_dim's, as llama.cpp takes it
    for gguf_norm, hf_norm in [
        ("ffn_norm", "pre_feedforward_layernorm"),
        ("post_attention_norm", "post_attention_layernorm"),
    ]:
        assert torch.equal(
            state[f"model.layers.1.{hf_norm}.weight"], torch.from_numpy(extra[f"blk.1.{gguf_norm}.weight"])
        )


def test_a_gemma3_gguf_gives_its_local_layers_their_own_rope_base(tmp_path: Path) -> None:
    path, _ = gemma_gguf(
        tmp_path / "g.gguf", "gemma3", np.random.default_rng(14), {"gemma3.attention.sliding_window": 7}
    )
    config, state = load_gguf(path)
    assert (config.qk_norm, config.attention_softcap, config.logit_softcap) == ("head", 0.0, 0.0)
    assert config.attention_windows == (7, 7)  # five local layers to a global one: both of two local
    assert (config.window_rope_theta, config.rope_theta) == (10000.0, 500000.0)
    keys = {"gemma3.attention.sliding_window": 7, "gemma3.rope.freq_base_swa": 20000.0}
    config, _ = load_gguf(gemma_gguf(tmp_path / "h.gguf", "gemma3", np.random.default_rng(14), keys)[0])
    assert config.window_rope_theta == 20000.0


def test_a_phi3_gguf_with_longrope_factors_and_partial_rotary_reads_both(tmp_path: Path) -> None:
    weights, extra = phi3_weights(np.random.default_rng(15))
    short, long = np.linspace(1.0, 2.0, 6, dtype=np.float32), np.linspace(3.0, 5.0, 6, dtype=np.float32)
    extra.update({"rope_factors_short.weight": short, "rope_factors_long.weight": long})
    keys = {"phi3.rope.scaling.original_context_length": 64, "phi3.rope.scaling.attn_factor": 1.25}
    path = write_model_gguf(tmp_path / "p.gguf", "phi3", weights, extra_tensors=extra, extra_keys=keys, rope_dim=12)
    config, state = load_gguf(path)
    assert config.rotary_dim == 12 and config.rope_scaling.rope_type == "longrope"
    assert config.rope_scaling.short_factor == tuple(short.tolist()) and config.rope_scaling.long_factor == tuple(long)
    assert (config.rope_scaling.original_max_position_embeddings, config.rope_scaling.attention_factor) == (64, 1.25)
    assert not any("rope_factors" in name for name in state)


def test_16_bit_matrices_stay_16_bit_where_the_kernels_run_them(tmp_path: Path, caplog) -> None:
    """F16 against any activations; BF16 against bfloat16 ones, and widened with a log line against
    float32."""
    weights = random_hf_weights(np.random.default_rng(16), bias=False, tied=True)
    name = "model.layers.0.mlp.up_proj.weight"
    for qtype, dtype, kept_kind in [
        (Q.F16, torch.float32, "f16"),
        (Q.BF16, torch.bfloat16, "bf16"),
        (Q.BF16, torch.float32, None),
    ]:
        reader = open_gguf(write_model_gguf(tmp_path / f"{qtype.name}.gguf", "llama", weights, qtype=qtype))
        caplog.clear()
        with caplog.at_level("WARNING", logger="shoal.model.gguf_loader"):
            state = gguf_state_dict(reader, gguf_config(reader), dtype, keep_quantized=True)
        weight = state[name]
        assert (weight.kind if isinstance(weight, QuantizedWeight) else None) == kept_kind, (qtype, dtype)
        assert torch.equal(dense(weight).float(), gguf_state_dict(reader, gguf_config(reader))[name])
        assert bool(caplog.records) == (kept_kind is None)
