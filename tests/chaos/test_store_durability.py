"""Stored conversations outlive kill -9: of the router, with SQLite (WAL, each stored response synced
to disk), and of Redis, with AOF on, started again on its directory. While Redis is down the
Responses API answers 503 and chat completions go on."""

from __future__ import annotations

import openai
import pytest
import yaml

from tests.support.redis_server import start_redis_server
from tests.support.routers import start_router, stop
from tests.support.waiting import wait_for
from tests.support.workers import MODEL, free_port, start_worker, tiny_worker_args

SAMPLING = {"max_output_tokens": 12, "temperature": 0.8}


@pytest.fixture(scope="module")
def worker(tiny_model_dir, shoal_cache_dir):
    process, url = start_worker(tiny_worker_args(tiny_model_dir, MODEL), shoal_cache_dir)
    yield url
    stop(process)


@pytest.fixture
def router(worker, tmp_path):
    """Factory: a router over the worker with these `responses` settings; all stopped at the end."""
    started = []

    def start(responses: dict):
        config = tmp_path / f"router-{len(started)}.yaml"
        config.write_text(yaml.safe_dump({"workers": [{"url": worker}], "state": responses}))
        started.append(start_router(["--config", str(config)]))
        return started[-1]

    yield start
    for process, _ in started:
        if process.poll() is None:
            stop(process)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def conversation(url: str, turns: int, previous=None) -> list:
    """`turns` chained responses, each stored before its call returns."""
    chain = []
    for i in range(turns):
        previous = client(url).responses.create(
            model=MODEL,
            input=f"turn {i}",
            previous_response_id=previous.id if previous else openai.omit,
            extra_body={"seed": i},
            **SAMPLING,
        )
        chain.append(previous)
    return chain


def assert_kept(url: str, chain: list) -> None:
    """Every turn is there as it was answered, and the conversation goes on from the last one."""
    for stored in chain:
        assert client(url).responses.retrieve(stored.id) == stored
    [next_turn] = conversation(url, 1, previous=chain[-1])
    assert next_turn.previous_response_id == chain[-1].id
    assert next_turn.usage.input_tokens > chain[-1].usage.input_tokens  # the whole chain was its context


def test_a_conversation_survives_kill_9_of_its_router_with_sqlite(router, tmp_path):
    responses = {"store": "sqlite", "sqlite_path": str(tmp_path / "responses.sqlite3")}
    process, url = router(responses)
    chain = conversation(url, 3)
    process.kill()  # right after the last answer: nothing gets a chance to flush
    process.wait(timeout=30)
    _, url = router(responses)
    assert_kept(url, chain)


def test_a_conversation_survives_kill_9_of_redis_with_aof_and_chat_goes_on_meanwhile(router, tmp_path):
    port = free_port()
    redis, redis_url = start_redis_server(tmp_path, port=port, appendonly=True)
    try:
        _, url = router({"store": "redis", "redis_url": redis_url})
        chain = conversation(url, 2)
        redis.kill()
        redis.wait(timeout=30)
        with pytest.raises(openai.APIStatusError) as refused:
            conversation(url, 1, previous=chain[-1])
        assert refused.value.status_code == 503 and "Redis" in refused.value.message
        chat = client(url).chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert chat.usage.completion_tokens == 4
        redis, _ = start_redis_server(tmp_path, port=port, appendonly=True)
        wait_for(lambda: _store_answers(url, chain[0].id), timeout_s=30)
        assert_kept(url, chain)
    finally:
        redis.kill()
        redis.wait(timeout=30)


def _store_answers(url: str, response_id: str) -> bool:
    try:
        return client(url).responses.retrieve(response_id).id == response_id
    except openai.APIStatusError as exc:
        if exc.status_code == 503:
            return False
        raise
