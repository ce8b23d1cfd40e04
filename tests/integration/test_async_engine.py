"""The async engine streams tokens, reports errors per request, and aborts abandoned streams."""

from __future__ import annotations

import asyncio

import pytest

from shoal.engine.async_engine import AsyncLLMEngine
from shoal.engine.sampling_params import SamplingParams
from shoal.errors import EmptyPromptError

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def async_engine(make_tiny_engine):
    engine = AsyncLLMEngine(make_tiny_engine())
    yield engine
    engine.shutdown()


def test_streams_match_the_synchronous_engine(async_engine, make_tiny_engine):
    from tests.support.engine_runs import run_to_completion

    prompts = {f"s{i}": [5 + i, 20, 30 + i] for i in range(4)}
    expected = run_to_completion(make_tiny_engine(), {k: (p, PARAMS) for k, p in prompts.items()})

    async def collect(request_id, prompt):
        tokens, steps = [], 0
        async for out in async_engine.generate(prompt, PARAMS, request_id=request_id):
            tokens += out.new_token_ids
            steps += 1
        return tokens, steps

    async def main():
        return await asyncio.gather(*(collect(k, p) for k, p in prompts.items()))

    results = asyncio.run(main())
    for (tokens, steps), request_id in zip(results, prompts):
        assert tokens == expected[request_id]
        assert steps == len(tokens)


def test_bad_request_fails_alone(async_engine):
    async def main():
        with pytest.raises(EmptyPromptError):
            async for _ in async_engine.generate([], PARAMS):
                pass
        return [out async for out in async_engine.generate([5, 6], PARAMS)]

    outputs = asyncio.run(main())
    assert outputs[-1].finished


def test_abandoned_stream_is_aborted(async_engine):
    async def main():
        stream = async_engine.generate([5, 6, 7], SamplingParams(max_tokens=200, ignore_eos=True), request_id="gone")
        await stream.__anext__()
        await stream.aclose()
        for _ in range(100):
            if not async_engine.engine.has_unfinished_requests():
                return True
            await asyncio.sleep(0.05)
        return False

    assert asyncio.run(main())
