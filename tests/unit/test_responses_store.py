"""The response stores against their real backends: SQLite on a temporary file, Redis on a real
redis-server (see the redis_url fixture)."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid

import pytest

from shoal.router.config import ResponsesSettings
from shoal.router.responses_api.null_store import NullStore
from shoal.router.responses_api.open_store import open_store
from shoal.router.responses_api.redis_store import RedisStore
from shoal.router.responses_api.sqlite_store import SQLiteStore
from shoal.router.responses_api.store import StoredTurn, StoreUnavailable
from tests.support.redis_server import start_redis_server
from tests.support.workers import free_port


def turn(previous: str | None = None, text: str = "hello") -> StoredTurn:
    response = {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "previous_response_id": previous,
        "output": [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": text}]}],
    }
    items = [
        {
            "id": f"msg_{uuid.uuid4().hex}",
            "type": "message",
            "role": "user",
            "content": [{"type": "input_text", "text": "héllo ✓"}],
        }
    ]
    return StoredTurn(response, items, "anonymous")


@pytest.fixture(params=["sqlite", "redis"])
def settings(request, tmp_path) -> ResponsesSettings:
    if request.param == "sqlite":
        return ResponsesSettings(store="sqlite", sqlite_path=str(tmp_path / "nested" / "responses.sqlite3"))
    return ResponsesSettings(store="redis", redis_url=request.getfixturevalue("redis_url"))


def test_a_stored_turn_reads_back_whole_until_deleted(settings):
    async def scenario():
        store = await open_store(settings)
        first = turn()
        second = turn(previous=first.response_id)
        await store.put(first)
        await store.put(second)
        got = await store.get(second.response_id)
        assert got == second and got.previous_response_id == first.response_id
        assert await store.get("resp_unknown") is None
        assert await store.delete(first.response_id) is True
        assert await store.delete(first.response_id) is False
        assert await store.get(first.response_id) is None
        assert await store.get(second.response_id) == second
        replaced = StoredTurn({**second.response, "status": "completed"}, second.input_items, second.owner)
        await store.put(replaced)
        assert await store.get(second.response_id) == replaced
        await store.close()

    asyncio.run(scenario())


def test_sqlite_survives_a_reopen_and_runs_in_wal_mode(tmp_path):
    path = tmp_path / "responses.sqlite3"
    stored = turn()

    async def write():
        store = await SQLiteStore.open(path)
        await store.put(stored)
        await store.close()

    async def read() -> StoredTurn | None:
        store = await SQLiteStore.open(path)
        try:
            return await store.get(stored.response_id)
        finally:
            await store.close()

    asyncio.run(write())
    assert asyncio.run(read()) == stored
    with sqlite3.connect(path) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.parametrize("policy,pragma", [("full", 2), ("normal", 1)])
def test_sqlite_syncs_each_stored_response_to_disk_unless_told_normal(tmp_path, policy, pragma):
    async def scenario() -> int:
        store = await open_store(
            ResponsesSettings(sqlite_path=str(tmp_path / "responses.sqlite3"), sqlite_synchronous=policy)
        )
        try:
            return await store._run(lambda: store._connection.execute("PRAGMA synchronous").fetchone()[0])
        finally:
            await store.close()

    assert asyncio.run(scenario()) == pragma
    assert ResponsesSettings().sqlite_synchronous == "full"


def test_a_redis_server_without_aof_is_named_in_a_warning_once(redis_url, caplog):
    async def scenario():
        store = await open_store(ResponsesSettings(store="redis", redis_url=redis_url))
        for _ in range(2):
            await store.put(turn())
        await store.close()

    asyncio.run(scenario())  # the tests' redis-server runs without persistence
    warnings = [r.getMessage() for r in caplog.records if "appendonly" in r.getMessage()]
    assert len(warnings) == 1 and "appendonly no" in warnings[0]


def test_a_redis_server_that_syncs_its_aof_only_each_second_is_named_in_a_warning(tmp_path, caplog):
    server, url = start_redis_server(tmp_path, appendonly=True)
    try:

        async def scenario():
            store = await open_store(ResponsesSettings(store="redis", redis_url=url))
            await store._client.config_set("appendfsync", "everysec")
            await store.put(turn())
            await store.close()

        asyncio.run(scenario())
    finally:
        server.kill()
        server.wait(timeout=30)
    warnings = [r.getMessage() for r in caplog.records if "appendfsync" in r.getMessage()]
    assert len(warnings) == 1 and "appendfsync everysec" in warnings[0]


def test_sqlite_expands_home_and_creates_the_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))

    async def scenario():
        store = await open_store(ResponsesSettings(sqlite_path="~/.local/state/shoal/responses.sqlite3"))
        await store.close()

    asyncio.run(scenario())
    assert (tmp_path / ".local" / "state" / "shoal" / "responses.sqlite3").is_file()


def test_two_redis_stores_share_one_server(redis_url):
    async def scenario():
        first, second = RedisStore.open(redis_url), RedisStore.open(redis_url)
        stored = turn()
        await first.put(stored)
        assert await second.get(stored.response_id) == stored
        assert await second.delete(stored.response_id) is True
        assert await first.get(stored.response_id) is None
        await first.close()
        await second.close()

    asyncio.run(scenario())


def test_an_unreachable_redis_is_store_unavailable():
    async def scenario():
        store = RedisStore.open(f"redis://127.0.0.1:{free_port()}/0")
        for call in (store.get("resp_x"), store.put(turn()), store.delete("resp_x")):
            with pytest.raises(StoreUnavailable):
                await call
        await store.close()

    asyncio.run(scenario())


def test_the_null_store_keeps_nothing():
    async def scenario():
        store = await open_store(ResponsesSettings(store="none"))
        assert isinstance(store, NullStore)
        stored = turn()
        await store.put(stored)
        assert await store.get(stored.response_id) is None and await store.delete(stored.response_id) is False

    asyncio.run(scenario())
