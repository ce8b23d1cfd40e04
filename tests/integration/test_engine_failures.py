"""A request that makes the engine fail is failed alone; the others finish with the tokens they
would have produced anyway, and the engine keeps serving."""

from __future__ import annotations

import asyncio

import pytest

from shoal.engine.async_engine import AsyncLLMEngine
from shoal.engine.sampling_params import SamplingParams
from shoal.errors import EngineRequestError
from tests.support.engine_runs import run_to_completion

PARAMS = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
PROMPTS = {"a": [5, 6, 7], "poison": [8, 9, 10, 11], "b": [12, 13]}


def poison_forward(engine, after_tokens: int = 2) -> None:
    """Makes every forward pass that contains request "poison" raise once it has `after_tokens` outputs."""
    real_run = engine.runner.run

    def run(batch):
        poison = engine.sequences.get("poison")
        poisoned = poison and list(poison.block_tables[0]) in batch.block_tables[0]
        if poisoned and len(poison.output_token_ids) >= after_tokens:
            raise RuntimeError("kernel fault on poison")
        return real_run(batch)

    engine.runner.run = run


def test_only_the_failing_request_fails_and_the_rest_are_unchanged(make_tiny_engine):
    expected = run_to_completion(make_tiny_engine(), {k: (p, PARAMS) for k, p in PROMPTS.items()})
    engine = make_tiny_engine()
    poison_forward(engine)
    for request_id, prompt in PROMPTS.items():
        engine.add_request(request_id, prompt, PARAMS)
    finals = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finals[output.request_id] = output
        engine.check_integrity()
    assert finals["poison"].outputs[0].finish_reason == "error" and "kernel fault" in str(finals["poison"].error)
    assert finals["poison"].outputs[0].token_ids == expected["poison"][:2]
    for request_id in ("a", "b"):
        assert finals[request_id].error is None
        assert finals[request_id].outputs[0].token_ids == expected[request_id]
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # Still serving.
    assert run_to_completion(engine, {"after": (PROMPTS["a"], PARAMS)})["after"] == expected["a"]


def test_a_fault_no_single_request_explains_fails_that_batch_only(make_tiny_engine):
    engine = make_tiny_engine()
    real_run = engine.runner.run
    faults = {"left": 1}

    def flaky_run(batch):
        if len(batch.query_lens) > 1 and faults["left"]:
            faults["left"] -= 1
            raise MemoryError("transient")
        return real_run(batch)

    engine.runner.run = flaky_run
    engine.add_request("x", [5, 6], PARAMS)
    engine.add_request("y", [7, 8], PARAMS)
    failed = {o.request_id for o in engine.step() if o.error}
    assert failed == {"x", "y"} and not engine.has_unfinished_requests()
    assert run_to_completion(engine, {"z": ([9, 10], PARAMS)})["z"]


def test_async_engine_raises_for_the_failed_request_only(make_tiny_engine):
    inner = make_tiny_engine()
    poison_forward(inner, after_tokens=0)
    engine = AsyncLLMEngine(lambda: inner)

    async def collect(request_id):
        return [t async for out in engine.generate(PROMPTS[request_id], PARAMS, request_id) for t in out.new_token_ids]

    async def main():
        return await asyncio.gather(*(collect(k) for k in PROMPTS), return_exceptions=True)

    try:
        results = dict(zip(PROMPTS, asyncio.run(main())))
    finally:
        engine.shutdown()
    assert isinstance(results["poison"], EngineRequestError)
    assert len(results["a"]) == 10 and len(results["b"]) == 10


@pytest.mark.parametrize("batch", [1, 4])
def test_calibration_measures_speeds_and_leaves_the_engine_clean(make_tiny_engine, batch):
    from shoal.engine.calibration import calibrate

    engine = make_tiny_engine()
    result = calibrate(engine, prompt_tokens=32, decode_steps=3, batch=batch)
    assert result.prefill_tokens_per_s > 0 and result.decode_tokens_per_s > 0
    assert result.capability == result.batched_decode_tokens_per_s > 0 and result.batch == batch
    stats = engine.stats()
    assert not engine.has_unfinished_requests() and stats.generation_tokens == 0 and stats.prompt_tokens == 0
    assert stats.prefix_cache_query_tokens == 0 and stats.num_free_blocks == stats.num_kv_blocks
    assert stats.prefill_tokens_per_s == result.prefill_tokens_per_s
    engine.check_integrity()


def test_a_restart_with_the_same_key_reuses_the_calibration_and_only_warms_up(make_tiny_engine, tmp_path):
    from shoal.engine.calibration import calibrate, calibration_path

    first = make_tiny_engine()
    path = calibration_path(first, tmp_path)
    assert calibration_path(make_tiny_engine(step_delay_ms=5), tmp_path) != path  # another engine, another key
    measured = calibrate(first, path, prompt_tokens=32, decode_steps=3, batch=2)
    assert path.exists()
    again = make_tiny_engine()
    reused = calibrate(again, calibration_path(again, tmp_path), prompt_tokens=32, decode_steps=3, batch=2)
    assert (reused.prefill_tokens_per_s, reused.decode_tokens_per_s, reused.capability, reused.batch) == (
        measured.prefill_tokens_per_s,
        measured.decode_tokens_per_s,
        measured.capability,
        measured.batch,
    )
    stats = again.stats()
    assert not again.has_unfinished_requests() and stats.generation_tokens == 0
    assert stats.prefill_tokens_per_s == measured.prefill_tokens_per_s
    path.write_text("not json")  # a damaged file is measured again, not trusted
    assert calibrate(make_tiny_engine(), path, prompt_tokens=32, decode_steps=3, batch=2).batch == 2
