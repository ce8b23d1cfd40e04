"""The family registry: each family is found by its names, an unknown one is a clear error, and
each family reads its sliding windows from config.json as transformers does."""

from __future__ import annotations

import math

import pytest
import torch

from shoal.model.errors import ModelLoadError
from shoal.model.families import (
    FAMILIES,
    family_named,
    family_of_gguf_architecture,
    family_of_hf_model_type,
)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_family_is_found_by_each_of_its_names(family):
    assert family_named(family.name) is family
    for model_type in family.hf_model_types:
        assert family_of_hf_model_type(model_type, "config.json") is family
    for architecture in family.gguf_architectures:
        assert family_of_gguf_architecture(architecture, "model.gguf") is family


def test_an_unknown_family_is_an_error_naming_the_file_and_the_name():
    with pytest.raises(ModelLoadError, match=r"models/x: model_type 'gemma9' is not supported"):
        family_of_hf_model_type("gemma9", "models/x")
    with pytest.raises(ModelLoadError, match=r"GGUF m.gguf: GGUF architecture 'gemma9' is not supported"):
        family_of_gguf_architecture("gemma9", "GGUF m.gguf")


def windows(model_type: str, **raw) -> tuple[int, ...]:
    return family_of_hf_model_type(model_type, "config.json").windows({"num_hidden_layers": 4, **raw})


def test_sliding_windows_are_read_per_family():
    assert windows("llama", sliding_window=64) == ()
    assert windows("mistral", sliding_window=64) == (64, 64, 64, 64)
    assert windows("mistral", sliding_window=None) == ()
    assert windows("qwen2", sliding_window=64, max_window_layers=2) == ()  # use_sliding_window is off
    assert windows("qwen2", use_sliding_window=True, sliding_window=64, max_window_layers=2) == (0, 0, 64, 64)
    layer_types = ["sliding_attention", "full_attention"] * 2
    assert windows("qwen3", use_sliding_window=True, sliding_window=8, layer_types=layer_types) == (8, 0, 8, 0)
    with pytest.raises(ValueError, match="layer_types names 2 layers"):
        windows("mistral", sliding_window=8, layer_types=layer_types[:2])


def test_gemma_windows_every_layer_but_each_patternth_unless_layer_types_say():
    assert windows("gemma2", sliding_window=16) == (16, 0, 16, 0)
    assert windows("gemma3_text", sliding_window=16, num_hidden_layers=7) == (16,) * 5 + (0, 16)
    assert windows("gemma3_text", sliding_window=16, sliding_window_pattern=2) == (16, 0, 16, 0)
    layer_types = ["full_attention", "sliding_attention"] * 2
    assert windows("gemma3_text", sliding_window=16, layer_types=layer_types) == (0, 16, 0, 16)


def gemma_config(model_type: str, **raw):
    from shoal.model.hf_loader import config_from_hf

    base = dict(vocab_size=32, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4)
    return config_from_hf({**base, "head_dim": 16, **raw}, family_of_hf_model_type(model_type, "config.json"))


def test_gemma_configs_carry_their_scales_caps_and_rope_bases():
    config = gemma_config("gemma2", query_pre_attn_scalar=144, attn_logit_softcapping=50.0, sliding_window=8)
    assert (config.attention_scale, config.attention_softcap, config.logit_softcap) == (144**-0.5, 50.0, 0.0)
    assert config.embedding_multiplier == 8.0 and config.mlp_activation == "gelu_tanh"
    assert config.norms_before and config.norms_after and config.window_rope_theta == 0.0
    # Gemma 3 as its published config.json writes RoPE, and as transformers 5 does.
    old = gemma_config(
        "gemma3_text", rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0}
    )
    new = gemma_config(
        "gemma3_text",
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    for config in (old, new):
        assert (config.rope_theta, config.window_rope_theta, config.rope_scaling.factor) == (1e6, 1e4, 8.0)
    with pytest.raises(ValueError, match="MLP activation 'relu'"):
        gemma_config("gemma2", hidden_activation="relu")


def test_smollm3_leaves_rope_out_of_every_fourth_layer_unless_it_names_them():
    rotary = family_of_hf_model_type("smollm3", "config.json").rotary
    assert rotary({"num_hidden_layers": 8}) == (True, True, True, False) * 2
    assert rotary({"num_hidden_layers": 3, "no_rope_layers": [1, 0, 1]}) == (True, False, True)
    with pytest.raises(ValueError, match="no_rope_layers names 2 layers"):
        rotary({"num_hidden_layers": 3, "no_rope_layers": [1, 0]})


def test_tensor_parallelism_refuses_norms_over_whole_projections():
    from shoal.model.config import LlamaConfig
    from shoal.model.sharding import check_shardable

    config = LlamaConfig(
        64, 64, 96, 2, 4, 2, 16, qk_norm="projection", norms_before=False, norms_after=True, architecture="olmo2"
    )
    check_shardable(config, 1)
    with pytest.raises(ValueError, match="olmo2's norms over whole q/k projections"):
        check_shardable(config, 2)


def test_rope_that_shoal_does_not_compute_is_refused_not_approximated():
    from shoal.model.config import RopeScaling

    with pytest.raises(ValueError, match="'mrope' is not supported"):
        RopeScaling.from_hf({"rope_type": "mrope", "mrope_section": [16, 24, 24]})
    with pytest.raises(ValueError, match="yarn needs original_max_position_embeddings"):
        RopeScaling.from_hf({"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="longrope needs original_max_position_embeddings"):
        RopeScaling.from_hf({"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0]})


def test_longrope_takes_its_long_factors_only_past_its_original_context():
    from shoal.model.config import RopeScaling

    raw = {"rope_type": "longrope", "short_factor": [1.0, 1.5], "long_factor": [3.0, 4.0]}
    longrope = RopeScaling.from_hf(raw, original_max_positions=4096)
    short, long = longrope.for_context(4096, 131072), longrope.for_context(4097, 131072)
    assert (short.rope_type, short.frequency_factors, long.frequency_factors) == (
        "frequency_factors",
        (1.0, 1.5),
        (3.0, 4.0),
    )
    # transformers' attention factor, from the model's context over the original, either way.
    assert short.attention_factor == long.attention_factor == pytest.approx((1 + math.log(32) / math.log(4096)) ** 0.5)
    assert RopeScaling().for_context(10, 10) == RopeScaling()


def test_partial_rotary_gathers_each_heads_rotated_halves_to_the_front_of_the_decoders():
    from shoal.model.config import LlamaConfig
    from shoal.model.hf_loader import config_from_hf
    from shoal.model.partial_rotary import decoder_order, gather_rotary_dims

    raw = dict(vocab_size=8, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4)
    config = config_from_hf({**raw, "partial_rotary_factor": 0.75}, family_of_hf_model_type("phi3", "config.json"))
    assert (config.head_dim, config.rotary_dim) == (16, 12)
    # Rotated pairs (0, 6) .. (5, 11) land on the decoder's (0, 8) .. (5, 13); 12-15 fill the rest.
    assert decoder_order(16, 12).tolist() == [0, 1, 2, 3, 4, 5, 12, 13, 6, 7, 8, 9, 10, 11, 14, 15]
    q = torch.arange(32.0).view(32, 1)  # two heads of one column
    gathered = gather_rotary_dims({"model.layers.0.self_attn.q_proj.weight": q}, config)
    assert gathered["model.layers.0.self_attn.q_proj.weight"].view(-1).tolist()[16:] == [
        16 + i for i in decoder_order(16, 12).tolist()
    ]
    whole = LlamaConfig(8, 64, 96, 1, 4, 2, 16)
    weights = {"model.layers.0.self_attn.q_proj.weight": q}
    assert gather_rotary_dims(weights, whole) is weights


def test_phi3_splits_its_fused_projections():
    from shoal.model.config import LlamaConfig

    phi3 = family_of_hf_model_type("phi3", "config.json")
    config = LlamaConfig(8, 64, 96, 1, 4, 2, 16, architecture="phi3")
    qkv = torch.arange((64 + 2 * 32) * 3.0).view(128, 3)
    parts = phi3.unfuse("model.layers.0.self_attn.qkv_proj.weight", qkv, config)
    assert [tuple(t.shape) for t in parts.values()] == [(64, 3), (32, 3), (32, 3)]
    assert torch.equal(torch.cat(list(parts.values())), qkv) and "model.layers.0.self_attn.k_proj.weight" in parts
    gate_up = torch.arange(192.0).view(192, 1)
    parts = phi3.unfuse("model.layers.0.mlp.gate_up_proj.weight", gate_up, config)
    assert torch.equal(parts["model.layers.0.mlp.gate_proj.weight"], gate_up[:96])
    with pytest.raises(ValueError, match="not 64 \\+ 2 x 32"):
        phi3.unfuse("model.layers.0.self_attn.qkv_proj.weight", qkv[:100], config)
