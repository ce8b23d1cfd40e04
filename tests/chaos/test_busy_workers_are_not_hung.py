"""No fault at all: long prompts prefill next to live streams, so those streams sit through engine
steps far longer than their usual inter-token gap. The workers say so in keep-alive comments, and
the router neither migrates a stream nor fails a request; an OpenAI client reading a worker
directly never sees the keep-alives.

Two real workers run a random model with 4,096 positions, taking a ~3,500-token prompt in one
prefill chunk: on the tiny model that one step costs seconds (its attention is quadratic), while a
decode step costs milliseconds, well under the router's 1 s minimum token deadline.
"""

from __future__ import annotations

import contextlib
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.fleet import router_config, start
from tests.support.routers import router_log, stop
from tests.support.waiting import wait_for
from tests.support.workers import MODEL, spawn_worker, wait_ready

LIVE_STREAMS = 4
LONG_PROMPTS = 4
LIVE_TOKENS = 120
LONG_PROMPT_CHARS = 3500  # the tiny tokenizer has one token per character


@pytest.fixture
def workers(long_tiny_model_dir, shoal_cache_dir, tmp_path):
    args = [
        "--model",
        str(long_tiny_model_dir),
        "--dtype",
        "float32",
        "--served-model-name",
        MODEL,
        "--kv-cache",
        "16MiB",
        "--max-model-len",
        "4096",
        "--max-num-batched-tokens",
        "4096",
        "--step-delay-ms",
        "20",
    ]
    with contextlib.ExitStack() as files:
        logs = [files.enter_context(open(tmp_path / f"worker-{i}.log", "wb")) for i in range(2)]
        started = [wait_ready(*w) for w in [spawn_worker(args, shoal_cache_dir, stderr=log) for log in logs]]
        yield [url for _, url in started]
        for process, _ in started:
            process.kill()
            process.wait(timeout=30)


def stream_through(url: str, body: dict, on_token=None) -> dict:
    """One streamed chat completion through the router: its token ids, the error events it
    carried, whether it ended with [DONE]. Keep-alive comments are skipped: whether a step is long
    enough to need one depends on the machine's speed at that moment."""
    ids, errors, done = [], [], False
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=300) as response:
        assert response.status_code == 200, response.read()
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                errors += [event["error"]] if "error" in event else []
                for choice in event.get("choices") or []:
                    ids += choice.get("token_ids") or []
                if on_token and ids:
                    on_token(len(ids))
    return {"ids": ids, "errors": errors, "done": done}


def chat(content: str, max_tokens: int, seed: int) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "seed": seed,
        "temperature": 0.8,
        "stream": True,
    }


def read_directly(worker_url: str) -> list:
    """The chunks of one stream read from a worker with the official OpenAI client."""
    client = openai.OpenAI(base_url=worker_url + "/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "direct"}],
        max_tokens=LIVE_TOKENS,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    return [chunk for chunk in stream if chunk.choices]


def counter(url: str, name: str) -> float:
    """A router counter summed over its labels (0 until something was counted)."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) for s in family.samples if s.name == name)


def test_long_prefills_beside_live_streams_cause_no_migration_and_no_failure(workers, tmp_path):
    router, url = start(router_config(tmp_path, workers, policy="round_robin"))
    try:
        with ThreadPoolExecutor(LIVE_STREAMS + LONG_PROMPTS + 1) as pool:
            progress = [0] * LIVE_STREAMS

            def live(i: int) -> dict:
                def seen(tokens: int) -> None:
                    progress[i] = tokens

                return stream_through(url, chat(f"live stream {i}", LIVE_TOKENS, seed=i), seen)

            lives = [pool.submit(live, i) for i in range(LIVE_STREAMS)]
            wait_for(lambda: all(p >= 5 for p in progress) or any(f.done() for f in lives), timeout_s=120)
            longs = [
                pool.submit(stream_through, url, chat(f"{i} " + "a" * LONG_PROMPT_CHARS, 4, seed=100 + i))
                for i in range(LONG_PROMPTS)
            ]
            # A client of the worker itself, through the same long steps: the keep-alives are comments.
            direct = pool.submit(read_directly, workers[0])
            results = [f.result() for f in lives + longs]
            chunks = direct.result()
        log = router_log(router)
        for result in results:
            assert result["errors"] == [] and result["done"], (result, log[-3000:])
        assert [len(r["ids"]) for r in results] == [LIVE_TOKENS] * LIVE_STREAMS + [4] * LONG_PROMPTS
        assert counter(url, "shoal_router_migrations_total") == 0, log[-3000:]
        assert "migrating" not in log
        assert sum(len(c.choices[0].model_extra.get("token_ids") or []) for c in chunks) == LIVE_TOKENS
        assert chunks[-1].choices[0].finish_reason == "length"
    finally:
        stop(router)
