"""The store for `state.store: none`: keeps nothing."""

from __future__ import annotations

from collections.abc import Callable

from shoal.router.state.records import Order, Page, Record


class NullRecords:
    """Invariant: nothing is ever found, so nothing stored can be continued, listed or deleted, and
    every lease is granted (with nothing stored, no two routers can find the same record)."""

    async def put(self, record: Record) -> None:
        return None

    async def get(self, kind: str, record_id: str) -> Record | None:
        return None

    async def delete(self, kind: str, record_id: str) -> bool:
        return False

    async def page(
        self,
        kind: str,
        owner: str | None,
        after: str | None = None,
        limit: int = 20,
        order: Order = "asc",
        match: Callable[[Record], bool] | None = None,
    ) -> Page:
        return Page([], False)

    async def claim(self, kind: str, record_id: str, holder: str, lease_s: float) -> bool:
        return True

    async def release(self, kind: str, record_id: str, holder: str) -> None:
        return None

    async def close(self) -> None:
        return None
