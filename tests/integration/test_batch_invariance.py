"""A request's tokens do not depend on its neighbours, the prefix cache, chunking or preemption."""

from __future__ import annotations

import pytest

from shoal.engine.sampling_params import SamplingParams
from tests.support.engine_runs import alone, batched, mixed_prompts, run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize(
    "params", [GREEDY, SamplingParams(temperature=0.9, top_p=0.95, max_tokens=24, seed=11, ignore_eos=True)]
)
def test_tiny_model_batch_of_16_equals_alone(make_tiny_engine, params):
    prompts = mixed_prompts(16, seed=3)
    expected = alone(make_tiny_engine, prompts, params)
    engine = make_tiny_engine(max_num_batched_tokens=48)
    assert batched(engine, prompts, params) == expected
    assert engine.stats().prefix_cache_hit_tokens > 0
    # Again on the warm engine: now every shared prefix comes from the cache.
    hits_before = engine.stats().prefix_cache_hit_tokens
    assert batched(engine, prompts, params) == expected
    assert engine.stats().prefix_cache_hit_tokens > hits_before


def test_tiny_model_forced_preemption_changes_nothing(make_tiny_engine):
    prompts = mixed_prompts(16, seed=5)
    expected = alone(make_tiny_engine, prompts, GREEDY)
    # 40 blocks of 4 tokens cannot hold 16 sequences of up to 100 tokens: preemption must happen.
    engine = make_tiny_engine(kv_cache_bytes=40 * 4 * engine_kv_bytes_per_token(make_tiny_engine))
    assert batched(engine, prompts, GREEDY) == expected
    assert engine.stats().num_preemptions > 0


def engine_kv_bytes_per_token(make_engine) -> int:
    return make_engine().model.kv_bytes_per_block_token()


def test_smollm2_batch_of_16_with_cache_hits_and_preemption(shoal_cache_dir):
    """The real model, float32: alone vs batched (prefix hits) vs batched under preemption."""
    from shoal.config.engine import EngineConfig
    from shoal.engine.engine import LLMEngine

    def make(**overrides):
        options = dict(
            dtype="float32",
            device="cpu",
            kv_cache_bytes=32 << 20,
            cache_dir=str(shoal_cache_dir),
            max_num_batched_tokens=256,
        )
        options.update(overrides)
        return LLMEngine(EngineConfig(**options))

    engine = make()
    prompts = mixed_prompts(16, seed=9, vocab=(100, 40000))
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [run_to_completion(engine, {f"a{i}": (p, params)})[f"a{i}"] for i, p in enumerate(prompts)]
    # Warm cache: the second half of the prompts share a prefix that is now cached.
    assert batched(engine, prompts, params) == expected
    bytes_per_token = engine.model.kv_bytes_per_block_token()
    tight = make(kv_cache_bytes=24 * 16 * bytes_per_token, enable_prefix_caching=False)
    assert batched(tight, prompts, params) == expected
    assert tight.stats().num_preemptions > 0
