"""The router's state store: records (stored responses and chat completions, files, batches and
their results) kept where every router of a group finds them, and leases that let one router at a
time work on a record."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

Order = Literal["asc", "desc"]


class StoreUnavailable(Exception):
    """The store could not be read or written (answered as 503; the router goes on)."""


@dataclass(frozen=True)
class Record:
    """One stored thing. Invariants: `id` is unique within `kind`; `owner` is who may see it (the
    client name that created it; for a batch's results, the batch id) and lists are per owner;
    lists run in (`created_at`, `id`) order; `body` is JSON-serialisable and comes back equal."""

    kind: str
    id: str
    owner: str
    created_at: float
    body: dict

    def to_json(self) -> str:
        return json.dumps(
            {"kind": self.kind, "id": self.id, "owner": self.owner, "created_at": self.created_at, "body": self.body}
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Record:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class Page:
    """Records of one owner in list order after a cursor, and whether more follow."""

    records: list[Record]
    has_more: bool


class RecordStore(Protocol):
    """Invariants: `get` returns what the last `put` of that (kind, id) stored, to any router sharing
    the store, until `delete`; `delete` says whether it was there. A lease on (kind, id) is held by
    one holder at a time: `claim` takes it when free or expired, or renews the holder's own, for
    `lease_s` seconds. Failures raise StoreUnavailable."""

    async def put(self, record: Record) -> None: ...

    async def get(self, kind: str, record_id: str) -> Record | None: ...

    async def delete(self, kind: str, record_id: str) -> bool: ...

    async def page(
        self,
        kind: str,
        owner: str | None,
        after: str | None = None,
        limit: int = 20,
        order: Order = "asc",
        match: Callable[[Record], bool] | None = None,
    ) -> Page:
        """Up to `limit` records of `owner` (every owner's when None) that `match`, following the
        record `after` (which need not match) in `order`; an unknown `after` gives an empty page."""
        ...

    async def claim(self, kind: str, record_id: str, holder: str, lease_s: float) -> bool: ...

    async def release(self, kind: str, record_id: str, holder: str) -> None: ...

    async def close(self) -> None: ...


async def owned_record(store: RecordStore, kind: str, record_id: str, owner: str) -> Record | None:
    """The record, if `owner` owns it (another owner's records are as unknown as missing ones)."""
    record = await store.get(kind, record_id)
    return record if record is not None and record.owner == owner else None


async def every_record(store: RecordStore, kind: str, owner: str | None, chunk: int = 1000) -> AsyncIterator[Record]:
    """Every record of `owner` (every owner's when None) in list order, read `chunk` at a time."""
    after = None
    while True:
        page = await store.page(kind, owner, after, chunk)
        for record in page.records:
            yield record
        if not page.has_more:
            return
        after = page.records[-1].id
