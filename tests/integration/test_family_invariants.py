"""What holds for Llama holds for every family: a request's tokens (greedy and seeded) do not depend
on its neighbours, the prefix cache or chunked prefill, in bfloat16 on the fused native layer, with
prompts longer than every sliding window."""

from __future__ import annotations

import pytest

from shoal.config.engine import EngineConfig
from shoal.engine.engine import LLMEngine
from shoal.engine.sampling_params import SamplingParams
from tests.support.engine_runs import alone, batched, mixed_prompts
from tests.support.family_variants import COMMON, LAYER_VARIANTS
from tests.support.tiny_model import write_random_family_model

FAMILIES = [
    "gemma2",
    "gemma3",
    "granite-multipliers",
    "olmo2-norms-after",
    "phi4-mini-partial-longrope",
    "qwen3-qk-norm",
]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=5, ignore_eos=True),
]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    config_class, model_class, fields = LAYER_VARIANTS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    write_random_family_model(directory, config_class, model_class, {**COMMON, **fields})
    return directory


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_each_familys_tokens_do_not_depend_on_the_batch_the_cache_or_chunking(family_model, params, shoal_cache_dir):
    def make_engine(**overrides) -> LLMEngine:
        options = dict(
            model=str(family_model),
            dtype="bfloat16",
            device="cpu",
            kv_cache_bytes=4 << 20,
            block_size=4,
            max_num_batched_tokens=32,
            cache_dir=str(shoal_cache_dir),
        )
        return LLMEngine(EngineConfig(**{**options, **overrides}))

    prompts = mixed_prompts(8, seed=9, vocab=(3, 98))
    prompts = [p + p for p in prompts]  # past the 21-token windows
    expected = alone(make_engine, prompts, params)
    engine = make_engine()
    assert batched(engine, prompts, params) == expected
    hits = engine.stats().prefix_cache_hit_tokens
    assert batched(engine, prompts, params) == expected
    assert engine.stats().prefix_cache_hit_tokens > hits
