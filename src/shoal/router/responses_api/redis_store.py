"""Stored responses in Redis, shared by every router that points at the same server."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import redis.asyncio as redis
from redis.exceptions import RedisError

from shoal.router.responses_api.store import StoredTurn, StoreUnavailable

log = logging.getLogger(__name__)

KEY_PREFIX = "shoal:response:"


@contextlib.contextmanager
def _unavailable_on_failure() -> Iterator[None]:
    try:
        yield
    except RedisError as exc:
        raise StoreUnavailable(f"the Redis response store failed: {exc}") from exc


class RedisStore:
    """Invariants: one key per stored turn (KEY_PREFIX + response id, the turn's JSON as value),
    written with one SET, so every router sees a turn whole or not at all; the connection pool
    reconnects by itself once the server is back, and a server that does not answer within the
    socket timeouts fails the call instead of hanging it. Durability is the server's: with AOF on
    and synced on every write (`appendonly yes`, `appendfsync always`) an acknowledged turn survives
    a Redis crash; the first stored turn checks, and a server with less is named in a warning."""

    def __init__(self, client: redis.Redis):
        self._client = client
        self._persistence_checked = False

    @classmethod
    def open(cls, url: str) -> RedisStore:
        """Connects lazily: a server that is down makes requests fail (503), not the router start."""
        return cls(redis.from_url(url, socket_connect_timeout=2.0, socket_timeout=5.0))

    async def put(self, turn: StoredTurn) -> None:
        with _unavailable_on_failure():
            await self._client.set(KEY_PREFIX + turn.response_id, turn.to_json())
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
                "the Redis response store runs with appendonly %s: stored responses since its last "
                "snapshot are lost when Redis restarts (run it with appendonly yes)",
                appendonly,
            )
        elif appendfsync != "always":
            log.warning(
                "the Redis response store runs with appendfsync %s: the last seconds of stored "
                "responses can be lost if Redis crashes (run it with appendfsync always)",
                appendfsync,
            )

    async def get(self, response_id: str) -> StoredTurn | None:
        with _unavailable_on_failure():
            text = await self._client.get(KEY_PREFIX + response_id)
        return StoredTurn.from_json(text) if text is not None else None

    async def delete(self, response_id: str) -> bool:
        with _unavailable_on_failure():
            return await self._client.delete(KEY_PREFIX + response_id) > 0

    async def close(self) -> None:
        await self._client.aclose()
