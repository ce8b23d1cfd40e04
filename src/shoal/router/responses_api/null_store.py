"""The store for `responses.store: none`: keeps nothing."""

from __future__ import annotations

from shoal.router.responses_api.store import StoredTurn


class NullStore:
    """Invariant: nothing is ever found, so no response can be continued, retrieved or deleted."""

    async def put(self, turn: StoredTurn) -> None:
        return None

    async def get(self, response_id: str) -> StoredTurn | None:
        return None

    async def delete(self, response_id: str) -> bool:
        return False

    async def close(self) -> None:
        return None
