"""Mixtures of experts from both formats: GGUF's stacked expert tensors become one matrix per
expert (kept quantized, with the file's blocks), and an expert count or top-k that contradicts the
tensors is a load error naming them."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q

from shoal.model.errors import ModelLoadError
from shoal.model.gguf_loader import gguf_config, gguf_state_dict, open_gguf
from shoal.model.hf_loader import load_hf
from shoal.model.quantized_weight import QuantizedWeight
from tests.support.family_variants import COMMON
from tests.support.gguf_models import HIDDEN, LAYERS, gguf_name, random_hf_weights
from tests.support.tiny_model import write_random_family_model

EXPERTS, TOP_K, EXPERT_INTER = 4, 2, 64
MIXTRAL = dict(num_local_experts=EXPERTS, num_experts_per_tok=TOP_K)


def stacked_moe_gguf(path: Path, experts_in_metadata: int = EXPERTS) -> tuple[Path, dict[str, np.ndarray]]:
    """A qwen3moe GGUF whose experts are stacked 3-D tensors in Q8_0, as llama.cpp's converter and
    quantizer write them; returns it and each stacked tensor's float values [E, rows, columns]."""
    rng = np.random.default_rng(4)
    dense = random_hf_weights(rng, bias=False, tied=True)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(96)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_key_length(16)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(experts_in_metadata)
    w.add_expert_used_count(TOP_K)
    w.add_expert_feed_forward_length(EXPERT_INTER)
    stacked = {}
    for name, value in dense.items():
        if ".mlp." in name:
            continue
        w.add_tensor(gguf_name(name), value)
    for layer in range(LAYERS):
        w.add_tensor(f"blk.{layer}.attn_q_norm.weight", np.ones(16, np.float32))
        w.add_tensor(f"blk.{layer}.attn_k_norm.weight", np.ones(16, np.float32))
        w.add_tensor(f"blk.{layer}.ffn_gate_inp.weight", rng.standard_normal((EXPERTS, HIDDEN)).astype(np.float32))
        for part, shape in (
            ("gate", (EXPERT_INTER, HIDDEN)),
            ("up", (EXPERT_INTER, HIDDEN)),
            ("down", (HIDDEN, EXPERT_INTER)),
        ):
            values = rng.standard_normal((EXPERTS, *shape)).astype(np.float32)
            name = f"blk.{layer}.ffn_{part}_exps.weight"
            stacked[name] = values
            w.add_tensor(name, gguf.quants.quantize(values, Q.Q8_0), raw_dtype=Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, stacked


def test_stacked_gguf_experts_become_one_quantized_matrix_each(tmp_path):
    path, stacked = stacked_moe_gguf(tmp_path / "moe.gguf")
    reader = open_gguf(path)
    config = gguf_config(reader)
    assert (config.num_experts, config.experts_per_token, config.expert_intermediate_size) == (EXPERTS, TOP_K, 64)
    assert config.normalize_expert_weights and all(config.sparse(i) for i in range(LAYERS))
    weights = gguf_state_dict(reader, config, keep_quantized=True)
    for layer in range(LAYERS):
        for part, hf in (("gate", "gate_proj"), ("up", "up_proj"), ("down", "down_proj")):
            values = stacked[f"blk.{layer}.ffn_{part}_exps.weight"]
            for expert in range(EXPERTS):
                weight = weights[f"model.layers.{layer}.mlp.experts.{expert}.{hf}.weight"]
                assert isinstance(weight, QuantizedWeight) and weight.kind == "q8_0"
                expected = gguf.quants.dequantize(gguf.quants.quantize(values[expert], Q.Q8_0), Q.Q8_0)
                assert torch.equal(weight.dequantize(), torch.from_numpy(np.ascontiguousarray(expected)))


def test_an_expert_count_that_does_not_divide_the_stacked_rows_names_the_tensor(tmp_path):
    path, _ = stacked_moe_gguf(tmp_path / "moe.gguf", experts_in_metadata=3)
    reader = open_gguf(path)
    with pytest.raises(ModelLoadError, match=r"tensor blk\.0\.ffn_gate_exps\.weight: .* 256 rows, not a multiple"):
        gguf_state_dict(reader, gguf_config(reader))


def write_mixtral(directory: Path, **config_changes) -> Path:
    write_random_family_model(directory, "MixtralConfig", "MixtralForCausalLM", {**COMMON, **MIXTRAL})
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, **config_changes}))
    return directory


def test_an_expert_count_that_contradicts_the_tensors_names_them(tmp_path):
    with pytest.raises(ModelLoadError, match=r"unexpected tensors \['model\.layers\.0\.mlp\.experts\.3\."):
        load_hf(write_mixtral(tmp_path, num_local_experts=3))
    with pytest.raises(ModelLoadError, match=r"missing tensors \['model\.layers\.0\.mlp\.experts\.4\."):
        load_hf(write_mixtral(tmp_path, num_local_experts=5))


def test_more_experts_a_token_than_experts_is_a_config_error(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json.*experts_per_token 5 must be 1 to num_experts 4"):
        load_hf(write_mixtral(tmp_path, num_experts_per_tok=5))
