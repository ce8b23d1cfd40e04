"""Chooses and opens the state store named by the router's configuration."""

from __future__ import annotations

from shoal.router.config import StateSettings
from shoal.router.state.null_records import NullRecords
from shoal.router.state.records import RecordStore


async def open_records(settings: StateSettings) -> RecordStore:
    """Each backend is imported only when chosen, so a router loads only the client it uses."""
    if settings.store == "sqlite":
        from shoal.router.state.sqlite_records import SQLiteRecords

        return await SQLiteRecords.open(settings.sqlite_path, settings.sqlite_synchronous)
    if settings.store == "redis":
        from shoal.router.state.redis_records import RedisRecords

        return RedisRecords.open(settings.redis_url)
    return NullRecords()


class SharedRecords:
    """The router's one state store, opened in its lifespan and shared by the APIs that keep things
    in it. Invariant: `store` is set from open() until close()."""

    def __init__(self, settings: StateSettings):
        self.settings = settings
        self.store: RecordStore | None = None

    async def open(self) -> None:
        """Called by the app's lifespan, inside the event loop."""
        self.store = await open_records(self.settings)

    async def close(self) -> None:
        await self.store.close()
