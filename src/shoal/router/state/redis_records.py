"""Records in Redis, shared by every router that points at the same server."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator

import redis.asyncio as redis
from redis.exceptions import RedisError

from shoal.router.state.records import Order, Page, Record, StoreUnavailable

log = logging.getLogger(__name__)

PREFIX = "shoal:"
SCAN_RECORDS = 100  # records read at a time while filling a page
# Takes a free or expired lease, or renews the holder's own: SET NX, else PEXPIRE if it is ours.
CLAIM = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]) return 1 end
return 0
"""
RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then redis.call('DEL', KEYS[1]) end return 0"


def _key(kind: str, record_id: str) -> str:
    return f"{PREFIX}{kind}:{record_id}"


def _index(kind: str, owner: str | None) -> str:
    """A sorted set of the ids of `kind` (of one owner, or all), scored by creation time."""
    return f"{PREFIX}index:{kind}" + ("" if owner is None else f":{owner}")


@contextlib.contextmanager
def _unavailable_on_failure() -> Iterator[None]:
    try:
        yield
    except RedisError as exc:
        raise StoreUnavailable(f"the Redis state store failed: {exc}") from exc


class RedisRecords:
    """Invariants: one key per record (its JSON), written in one transaction with its two index
    entries (per owner, and per kind), so every router sees a record whole or not at all; equal
    creation times list in id order (Redis orders equal scores by member), as SQLite does. The
    connection pool reconnects by itself once the server is back, and a server that does not
    answer within the socket timeouts fails the call instead of hanging it. Durability is the
    server's: with AOF on and synced on every write (`appendonly yes`, `appendfsync always`) an
    acknowledged record survives a Redis crash; the first write checks, and a server with less is
    named in a warning. A lease is a key that expires by itself."""

    def __init__(self, client: redis.Redis):
        self._client = client
        self._persistence_checked = False

    @classmethod
    def open(cls, url: str) -> RedisRecords:
        """Connects lazily: a server that is down makes requests fail (503), not the router start."""
        return cls(redis.from_url(url, socket_connect_timeout=2.0, socket_timeout=5.0))

    async def put(self, record: Record) -> None:
        with _unavailable_on_failure():
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.set(_key(record.kind, record.id), record.to_json())
                pipe.zadd(_index(record.kind, record.owner), {record.id: record.created_at})
                pipe.zadd(_index(record.kind, None), {record.id: record.created_at})
                await pipe.execute()
        if not self._persistence_checked:
            self._persistence_checked = True
            await self._warn_if_volatile()

    async def _warn_if_volatile(self) -> None:
        try:
            settings = await self._client.config_get("append*")
        except RedisError:  # CONFIG is often disabled on managed servers: they state their own policy
            return
        appendonly, appendfsync = settings.get("appendonly"), settings.get("appendfsync")
        if appendonly != "yes":
            log.warning(
                "the Redis state store runs with appendonly %s: what was stored since its last "
                "snapshot is lost when Redis restarts (run it with appendonly yes)",
                appendonly,
            )
        elif appendfsync != "always":
            log.warning(
                "the Redis state store runs with appendfsync %s: the last seconds of what was "
                "stored can be lost if Redis crashes (run it with appendfsync always)",
                appendfsync,
            )

    async def get(self, kind: str, record_id: str) -> Record | None:
        with _unavailable_on_failure():
            text = await self._client.get(_key(kind, record_id))
        return Record.from_json(text) if text is not None else None

    async def delete(self, kind: str, record_id: str) -> bool:
        record = await self.get(kind, record_id)
        if record is None:
            return False
        with _unavailable_on_failure():
            async with self._client.pipeline(transaction=True) as pipe:
                pipe.delete(_key(kind, record_id))
                pipe.zrem(_index(kind, record.owner), record_id)
                pipe.zrem(_index(kind, None), record_id)
                deleted, _, _ = await pipe.execute()
        return deleted > 0

    async def page(
        self,
        kind: str,
        owner: str | None,
        after: str | None = None,
        limit: int = 20,
        order: Order = "asc",
        match: Callable[[Record], bool] | None = None,
    ) -> Page:
        index, found = _index(kind, owner), []
        with _unavailable_on_failure():
            start = 0
            if after is not None:
                rank = await (self._client.zrank if order == "asc" else self._client.zrevrank)(index, after)
                if rank is None:
                    return Page([], False)
                start = rank + 1
            read_range = self._client.zrange if order == "asc" else self._client.zrevrange
            while True:
                ids = await read_range(index, start, start + SCAN_RECORDS - 1)
                texts = await self._client.mget([_key(kind, i.decode()) for i in ids]) if ids else []
                for text in texts:
                    if text is None:  # deleted between the two reads
                        continue
                    record = Record.from_json(text)
                    if match is None or match(record):
                        if len(found) == limit:
                            return Page(found, True)
                        found.append(record)
                if len(ids) < SCAN_RECORDS:
                    return Page(found, False)
                start += SCAN_RECORDS

    async def claim(self, kind: str, record_id: str, holder: str, lease_s: float) -> bool:
        with _unavailable_on_failure():
            taken = await self._client.eval(CLAIM, 1, f"{PREFIX}lease:{kind}:{record_id}", holder, int(lease_s * 1000))
        return bool(taken)

    async def release(self, kind: str, record_id: str, holder: str) -> None:
        with _unavailable_on_failure():
            await self._client.eval(RELEASE, 1, f"{PREFIX}lease:{kind}:{record_id}", holder)

    async def close(self) -> None:
        await self._client.aclose()
