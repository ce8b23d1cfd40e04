"""A Messages stream (the anthropic SDK's stream helper) whose worker is killed (kill -9) mid-way
goes on on another worker through the router and is, text and usage, the stream of a run without
the failure: the Messages API rides on the chat path's token-exact migration."""

from __future__ import annotations

import os
import signal

import anthropic
import pytest

from tests.support.failover_trio import failover_trio
from tests.support.workers import MODEL, scrape, tiny_worker_args

MAX_TOKENS = 150
SAMPLING = {"seed": 7, "temperature": 0.8, "ignore_eos": True}


@pytest.fixture
def pair(tiny_model_dir, shoal_cache_dir, tmp_path):
    """(router url, {worker url: process}): workers at 10 ms a step behind a router with a 1 s token
    deadline."""
    yield from failover_trio(tiny_worker_args(tiny_model_dir, MODEL, step_delay_ms=10), shoal_cache_dir, tmp_path)


def streamed(url: str, kill_after: int | None = None, processes: dict | None = None) -> anthropic.types.Message:
    """The final message of a streamed request; with `kill_after`, its worker is killed (SIGKILL)
    once that many text deltas have arrived."""
    client = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0, timeout=60)
    with client.messages.stream(
        model=MODEL,
        max_tokens=MAX_TOKENS,
        messages=[{"role": "user", "content": "tell me a long story"}],
        extra_body=SAMPLING,
    ) as stream:
        worker = stream.response.headers["x-shoal-worker"]
        deltas = 0
        for event in stream:
            if event.type != "text":
                continue
            deltas += 1
            if deltas == kill_after:
                os.kill(processes[worker].pid, signal.SIGKILL)
        return stream.get_final_message()


def migrations(url: str) -> float:
    return sum(v for k, v in scrape(url).items() if k.startswith("shoal_router_migrations_total"))


def test_a_messages_stream_survives_kill_9_of_its_worker(pair):
    url, processes = pair
    clean = streamed(url)
    assert clean.stop_reason == "max_tokens" and clean.usage.output_tokens == MAX_TOKENS
    faulty = streamed(url, kill_after=20, processes=processes)
    assert migrations(url) == 1
    assert faulty.content == clean.content and faulty.usage == clean.usage
    assert faulty.stop_reason == "max_tokens"
