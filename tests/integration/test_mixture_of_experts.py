"""Mixtures of experts: logits equal transformers' (tiny random Mixtral, Qwen3-MoE and gpt-oss, float32);
a row's tokens do not depend on which other rows share its experts, the batch, the cache or chunking;
a stream resumes token-exact on another engine, with its KV recomputed or moved."""

from __future__ import annotations

import functools

import pytest
import torch

from shoal.engine.sampling_params import SamplingParams
from tests.support.engine_runs import (
    assert_streams_resume_token_exact,
    assert_tokens_ignore_batch_cache_and_chunking,
    engine_factory,
)
from tests.support.family_variants import COMMON
from tests.support.logits import max_logit_difference
from tests.support.tiny_model import write_random_family_model

MOE_VARIANTS = {
    # 8 experts, top-2, renormalised; a window shorter than the prompt.
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=21),
    ),
    # 6 experts of their own width, top-3 renormalised; layer 1 of 3 dense (mlp_only_layers).
    "qwen3-moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=3,
            num_experts=6,
            num_experts_per_tok=3,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            mlp_only_layers=[1],
        ),
    ),
    # Attention sinks, a window of 21 on every other layer, q/k/v/o biases, YaRN; the best 2 of 4
    # experts' logits, then their softmax; biases on the router and experts; the clamped SwiGLU
    # (a limit the random activations pass).
    "gpt-oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            head_dim=16,
            intermediate_size=32,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=21,
            swiglu_limit=1.0,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
                "original_max_position_embeddings": 32,
                "rope_theta": 150000.0,
            },
        ),
    ),
    # Not renormalised: the top-k softmax weights as they are.
    "qwen3-moe-unnormalised": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False),
    ),
}


def write_variant(name, directory):
    config_class, model_class, fields = MOE_VARIANTS[name]
    return write_random_family_model(directory, config_class, model_class, {**COMMON, **fields})


@pytest.mark.parametrize("kernel", ["rows", "tiles"])
@pytest.mark.parametrize("variant", sorted(MOE_VARIANTS))
def test_moe_logits_match_transformers(variant, kernel, tmp_path, shoal_cache_dir):
    reference = write_variant(variant, tmp_path)
    layers = []

    def record(llm) -> None:
        layers.extend(llm.engine.model.layers)

    ids = list(range(3, 123))
    assert max_logit_difference(reference, tmp_path, shoal_cache_dir, ids, kernel, record) <= 1e-3
    # The rows kernel comes with the fused native layer, whose experts run in one native call.
    assert all((layer.native is not None) == (kernel == "rows") for layer in layers)
    assert all(layer.experts.kernel is not None for layer in layers if layer.experts is not None)


@pytest.mark.parametrize("variant", ["qwen3-moe-unnormalised", "gpt-oss"])
def test_the_native_experts_agree_with_the_torch_experts(variant, tmp_path):
    """The experts' C++ kernel and the torch code (CUDA, no compiler) route every row alike and give
    the same outputs to float32 rounding: softmax then top-k unnormalised, where the rule shows
    (Qwen3-MoE), and top-k then softmax with biases and the clamped SwiGLU (gpt-oss)."""
    from shoal.model.hf_loader import load_hf
    from shoal.model.mlp_gates import gate_function
    from shoal.model.moe import MixtureOfExperts

    write_variant(variant, tmp_path)
    config, weights = load_hf(tmp_path)
    x = torch.randn(37, config.hidden_size, generator=torch.Generator().manual_seed(3)) * 4
    make = functools.partial(MixtureOfExperts, config, weights, "model.layers.0.", 0, gate=gate_function(config))
    native, plain = make(prepack=True), make(prepack=False)
    assert native.kernel is not None and plain.kernel is None
    assert torch.allclose(native(x), plain(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("prepack", [True, False], ids=["native", "torch"])
def test_experts_held_apart_and_summed_give_the_whole_mixtures_bits(prepack, tmp_path):
    """Expert parallelism's arithmetic in one process: the outputs of experts 0-1 and 2-3, each
    computed where only they are held (zeros for the others' choices), summed, then weighted, equal
    the mixture run whole, bit for bit, on the native kernel and the torch code."""
    from shoal.model.hf_loader import load_hf
    from shoal.model.mlp_gates import gate_function
    from shoal.model.moe import MixtureOfExperts

    write_variant("gpt-oss", tmp_path)  # 4 experts, top-2, biases, the clamped SwiGLU
    config, weights = load_hf(tmp_path)
    weights = {name: tensor.to(torch.bfloat16) for name, tensor in weights.items()}
    x = (torch.randn(37, config.hidden_size, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16)
    make = functools.partial(MixtureOfExperts, config, weights, "model.layers.0.", 16, prepack, gate_function(config))
    whole = make()
    chosen, routing = whole.route(x)
    parts = [make(held=held).expert_outputs(x, chosen) for held in (range(0, 2), range(2, 4))]
    assert all(part.abs().sum() > 0 for part in parts)
    assert torch.equal(whole.weighted_sum(parts[0] + parts[1], routing), whole(x))


@pytest.fixture(scope="module", params=["mixtral", "qwen3-moe", "gpt-oss"])
def moe_model(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    write_variant(request.param, directory)
    return directory


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=5, ignore_eos=True),
    ],
    ids=["greedy", "seeded"],
)
def test_moe_tokens_do_not_depend_on_the_batch_the_cache_or_chunking(moe_model, params, shoal_cache_dir):
    make_engine = engine_factory(moe_model, shoal_cache_dir, dtype="bfloat16", max_num_batched_tokens=32)
    assert_tokens_ignore_batch_cache_and_chunking(make_engine, params)


def test_a_moe_stream_resumes_token_exact_on_another_engine(moe_model, shoal_cache_dir):
    make_engine = engine_factory(moe_model, shoal_cache_dir, dtype="bfloat16", max_num_batched_tokens=32)
    assert_streams_resume_token_exact(make_engine)
