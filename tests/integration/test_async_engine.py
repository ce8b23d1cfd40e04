"""The async engine streams tokens, reports errors per request, and aborts abandoned streams."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys

import pytest

from shoal.engine.async_engine import AsyncLLMEngine
from shoal.engine.sampling_params import SamplingParams
from shoal.errors import EmptyPromptError

PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture
def async_engine(make_tiny_engine):
    engine = AsyncLLMEngine(make_tiny_engine)
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


OPENMP_TEAMS_SCRIPT = """
import asyncio, os, sys
from pathlib import Path
import torch
from shoal.config.engine import EngineConfig
from shoal.engine.sampling_params import SamplingParams
from shoal.engine.startup import start_engine

config = EngineConfig(model=sys.argv[1], dtype="float32", device="cpu", kv_cache_bytes=4 << 20, block_size=4,
                      cache_dir=sys.argv[2], num_threads=2)
engine, _ = start_engine(config, Path(sys.argv[2]))

async def serve():
    async for _ in engine.generate([5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True)):
        pass

asyncio.run(serve())
threads = len(os.listdir("/proc/self/task"))
torch.ones(1 << 22).sum()  # a parallel region on the main thread
print(len(os.listdir("/proc/self/task")) - threads)
engine.shutdown()
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="needs Linux's /proc to count threads")
def test_a_started_engine_leaves_the_main_thread_without_an_openmp_team(tiny_model_dir, shoal_cache_dir):
    """GNU OpenMP keeps a thread team per thread that starts parallel regions, and stops spinning
    between regions when its teams hold more threads than the CPUs: a model loaded and calibrated on
    the main thread and stepped on the engine thread made every served token wait on sleeping
    threads. A started engine has run torch on its own thread only, so the first parallel region
    of the main thread still has to create that thread's team (a new OS thread)."""
    result = subprocess.run(
        [sys.executable, "-c", OPENMP_TEAMS_SCRIPT, str(tiny_model_dir), str(shoal_cache_dir)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert int(result.stdout.split()[-1]) == 1
