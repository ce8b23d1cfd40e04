"""The KV budget decides how many tokens fit (and the engine says so); every dtype runs invariantly."""

from __future__ import annotations

import pytest

from shoal.engine.sampling_params import SamplingParams
from tests.support.engine_runs import run_to_completion


def test_byte_budget_sets_the_token_capacity(make_tiny_engine):
    probe = make_tiny_engine()
    per_token = probe.model.kv_bytes_per_block_token()
    engine = make_tiny_engine(kv_cache_bytes=50 * 4 * per_token + 7)
    assert engine.max_cached_tokens == 200
    assert engine.stats().max_cached_tokens == 200 and engine.stats().num_kv_blocks == 50


def test_fraction_of_free_memory_is_capped_by_what_can_be_used(make_tiny_engine):
    engine = make_tiny_engine(kv_cache_bytes=None, kv_cache_fraction=0.01, max_num_seqs=2, max_model_len=64)
    assert engine.max_cached_tokens == 2 * 64


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_reduced_precision_is_batch_invariant(make_tiny_engine, dtype):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=16, ignore_eos=True)
    prompts = {f"p{i}": ([4 + i] * (3 + 5 * i), params) for i in range(6)}
    alone = {k: run_to_completion(make_tiny_engine(dtype=dtype), {k: v})[k] for k, v in prompts.items()}
    assert run_to_completion(make_tiny_engine(dtype=dtype), prompts) == alone


def test_invariance_can_be_turned_off(make_tiny_engine):
    """batch_invariant=False uses plain GEMMs; the engine still serves every request to the end."""
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    results = run_to_completion(
        make_tiny_engine(batch_invariant=False, share_weights=True),
        {f"q{i}": ([4 + i] * (2 + i), params) for i in range(5)},
    )
    assert sorted(len(t) for t in results.values()) == [10] * 5
