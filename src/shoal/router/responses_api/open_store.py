"""Chooses and opens the response store named by the router's configuration."""

from __future__ import annotations

from shoal.router.config import ResponsesSettings
from shoal.router.responses_api.null_store import NullStore
from shoal.router.responses_api.store import ResponseStore


async def open_store(settings: ResponsesSettings) -> ResponseStore:
    """Each backend is imported only when chosen, so a router loads only the client it uses."""
    if settings.store == "sqlite":
        from shoal.router.responses_api.sqlite_store import SQLiteStore

        return await SQLiteStore.open(settings.sqlite_path, settings.sqlite_synchronous)
    if settings.store == "redis":
        from shoal.router.responses_api.redis_store import RedisStore

        return RedisStore.open(settings.redis_url)
    return NullStore()
