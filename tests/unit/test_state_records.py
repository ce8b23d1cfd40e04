"""The state stores against their real backends: SQLite on a temporary file, Redis on a real
redis-server (see the redis_url fixture)."""

from __future__ import annotations

import asyncio
import sqlite3
import uuid

import pytest

from shoal.router.config import StateSettings
from shoal.router.responses_api.stored_turn import KIND, StoredTurn
from shoal.router.state.null_records import NullRecords
from shoal.router.state.open_records import open_records
from shoal.router.state.records import Record, StoreUnavailable
from shoal.router.state.redis_records import RedisRecords
from shoal.router.state.sqlite_records import SQLiteRecords
from tests.support.redis_server import start_redis_server
from tests.support.workers import free_port


def turn(previous: str | None = None, text: str = "hello") -> Record:
    response = {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": 1_700_000_000,
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
    return StoredTurn(response, items, "anonymous").record()


@pytest.fixture(params=["sqlite", "redis"])
def settings(request, tmp_path) -> StateSettings:
    if request.param == "sqlite":
        return StateSettings(store="sqlite", sqlite_path=str(tmp_path / "nested" / "state.sqlite3"))
    return StateSettings(store="redis", redis_url=request.getfixturevalue("redis_url"))


def test_a_stored_turn_reads_back_whole_until_deleted(settings):
    async def scenario():
        store = await open_records(settings)
        first = turn()
        second = turn(previous=first.id)
        await store.put(first)
        await store.put(second)
        got = await store.get(KIND, second.id)
        assert got == second and StoredTurn.from_record(got).previous_response_id == first.id
        assert await store.get(KIND, "resp_unknown") is None
        assert await store.delete(KIND, first.id) is True
        assert await store.delete(KIND, first.id) is False
        assert await store.get(KIND, first.id) is None
        assert await store.get(KIND, second.id) == second
        replaced = Record(KIND, second.id, second.owner, second.created_at, {**second.body, "status": "completed"})
        await store.put(replaced)
        assert await store.get(KIND, second.id) == replaced
        await store.close()

    asyncio.run(scenario())


def test_sqlite_survives_a_reopen_and_runs_in_wal_mode(tmp_path):
    path = tmp_path / "state.sqlite3"
    stored = turn()

    async def write():
        store = await SQLiteRecords.open(path)
        await store.put(stored)
        await store.close()

    async def read() -> Record | None:
        store = await SQLiteRecords.open(path)
        try:
            return await store.get(KIND, stored.id)
        finally:
            await store.close()

    asyncio.run(write())
    assert asyncio.run(read()) == stored
    with sqlite3.connect(path) as connection:
        assert connection.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


@pytest.mark.parametrize("policy,pragma", [("full", 2), ("normal", 1)])
def test_sqlite_syncs_each_stored_response_to_disk_unless_told_normal(tmp_path, policy, pragma):
    async def scenario() -> int:
        store = await open_records(
            StateSettings(sqlite_path=str(tmp_path / "state.sqlite3"), sqlite_synchronous=policy)
        )
        try:
            return await store._run(lambda: store._connection.execute("PRAGMA synchronous").fetchone()[0])
        finally:
            await store.close()

    assert asyncio.run(scenario()) == pragma
    assert StateSettings().sqlite_synchronous == "full"


def test_a_redis_server_without_aof_is_named_in_a_warning_once(redis_url, caplog):
    async def scenario():
        store = await open_records(StateSettings(store="redis", redis_url=redis_url))
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
            store = await open_records(StateSettings(store="redis", redis_url=url))
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
        store = await open_records(StateSettings(sqlite_path="~/.local/state/shoal/state.sqlite3"))
        await store.close()

    asyncio.run(scenario())
    assert (tmp_path / ".local" / "state" / "shoal" / "state.sqlite3").is_file()


def test_two_redis_stores_share_one_server(redis_url):
    async def scenario():
        first, second = RedisRecords.open(redis_url), RedisRecords.open(redis_url)
        stored = turn()
        await first.put(stored)
        assert await second.get(KIND, stored.id) == stored
        assert await second.delete(KIND, stored.id) is True
        assert await first.get(KIND, stored.id) is None
        await first.close()
        await second.close()

    asyncio.run(scenario())


def test_an_unreachable_redis_is_store_unavailable():
    async def scenario():
        store = RedisRecords.open(f"redis://127.0.0.1:{free_port()}/0")
        for call in (store.get(KIND, "resp_x"), store.put(turn()), store.delete(KIND, "resp_x")):
            with pytest.raises(StoreUnavailable):
                await call
        await store.close()

    asyncio.run(scenario())


def test_the_null_store_keeps_nothing():
    async def scenario():
        store = await open_records(StateSettings(store="none"))
        assert isinstance(store, NullRecords)
        stored = turn()
        await store.put(stored)
        assert await store.get(KIND, stored.id) is None and await store.delete(KIND, stored.id) is False

    asyncio.run(scenario())


def test_pages_list_one_owner_s_records_in_creation_order_after_a_cursor(settings):
    async def scenario():
        store = await open_records(settings)
        kind = f"thing-{uuid.uuid4().hex[:6]}"
        mine = [Record(kind, f"id-{i:03d}", "me", 100.0 + i // 2, {"n": i}) for i in range(250)]
        for record in mine[::-1]:  # stored out of order: the list follows creation time, then id
            await store.put(record)
        await store.put(Record(kind, "theirs", "them", 150.0, {"n": -1}))
        first = await store.page(kind, "me", limit=20)
        assert first.records == mine[:20] and first.has_more
        rest = await store.page(kind, "me", after=mine[19].id, limit=1000)
        assert rest.records == mine[20:] and not rest.has_more
        newest = await store.page(kind, "me", limit=3, order="desc")
        assert newest.records == mine[::-1][:3]
        assert (await store.page(kind, "me", after=mine[3].id, limit=2, order="desc")).records == [mine[2], mine[1]]
        odd = await store.page(kind, "me", limit=120, match=lambda r: r.body["n"] % 2 == 1)  # across scan chunks
        assert odd.records == mine[1::2][:120] and odd.has_more
        assert len((await store.page(kind, None, limit=1000)).records) == 251  # every owner's
        assert (await store.page(kind, "me", after="no-such-id")).records == []
        assert await store.delete(kind, mine[0].id)
        assert (await store.page(kind, "me", limit=1)).records == [mine[1]]
        await store.close()

    asyncio.run(scenario())


def test_a_lease_has_one_holder_until_released_or_expired(settings):
    async def scenario():
        store = await open_records(settings)
        kind, record_id = "batch", f"batch_{uuid.uuid4().hex}"
        assert await store.claim(kind, record_id, "router-a", 30)
        assert not await store.claim(kind, record_id, "router-b", 30)
        assert await store.claim(kind, record_id, "router-a", 0.2)  # its holder renews it
        await asyncio.sleep(0.4)
        assert await store.claim(kind, record_id, "router-b", 30)  # expired: another takes it
        await store.release(kind, record_id, "router-a")  # not the holder: nothing changes
        assert not await store.claim(kind, record_id, "router-a", 30)
        await store.release(kind, record_id, "router-b")
        assert await store.claim(kind, record_id, "router-a", 30)
        await store.close()

    asyncio.run(scenario())
