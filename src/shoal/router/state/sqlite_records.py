"""Records in one SQLite file: embedded, the default, and kept across router restarts."""

from __future__ import annotations

import asyncio
import json
import sqlite3
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from shoal.router.state.records import Order, Page, Record, StoreUnavailable

T = TypeVar("T")

SYNCHRONOUS = {"full": "FULL", "normal": "NORMAL"}  # StateSettings.sqlite_synchronous -> the pragma
SCHEMA = (
    "CREATE TABLE IF NOT EXISTS records (kind TEXT NOT NULL, id TEXT NOT NULL, owner TEXT NOT NULL,"
    " created REAL NOT NULL, body TEXT NOT NULL, PRIMARY KEY (kind, id)) WITHOUT ROWID",
    "CREATE INDEX IF NOT EXISTS records_by_owner ON records (kind, owner, created, id)",
    "CREATE INDEX IF NOT EXISTS records_by_time ON records (kind, created, id)",
    "CREATE TABLE IF NOT EXISTS leases (kind TEXT NOT NULL, id TEXT NOT NULL, holder TEXT NOT NULL,"
    " until REAL NOT NULL, PRIMARY KEY (kind, id)) WITHOUT ROWID",
)
SCAN_ROWS = 100  # rows read at a time while filling a page


def _connect(path: Path, synchronous: str) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    connection = sqlite3.connect(path, isolation_level=None, timeout=5.0)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute(f"PRAGMA synchronous={SYNCHRONOUS[synchronous]}")
    for statement in SCHEMA:
        connection.execute(statement)
    return connection


def _record(row: tuple) -> Record:
    kind, record_id, owner, created, body = row
    return Record(kind, record_id, owner, created, json.loads(body))


class SQLiteRecords:
    """Invariants: the connection is only touched by the store's one thread, so the event loop never
    blocks on the file; each write is one autocommitted statement, so a record is stored whole or
    not at all and outlives the process (WAL mode: readers do not wait for the writer, and routers
    on one host may share the file); with synchronous `full` it is on disk before `put` returns."""

    def __init__(self, executor: ThreadPoolExecutor, connection: sqlite3.Connection):
        self._executor = executor
        self._connection = connection

    @classmethod
    async def open(cls, path: str | Path, synchronous: str = "full") -> SQLiteRecords:
        """Opens (creating the file and its directory if needed) the store at `path` (`~` expanded)."""
        executor = ThreadPoolExecutor(1, thread_name_prefix="shoal-state-sqlite")
        connection = await asyncio.get_running_loop().run_in_executor(
            executor, _connect, Path(path).expanduser(), synchronous
        )
        return cls(executor, connection)

    async def _run(self, call: Callable[[], T]) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"the SQLite state store failed: {exc}") from exc

    async def put(self, record: Record) -> None:
        row = (record.kind, record.id, record.owner, record.created_at, json.dumps(record.body))
        await self._run(lambda: self._connection.execute("INSERT OR REPLACE INTO records VALUES (?, ?, ?, ?, ?)", row))

    async def get(self, kind: str, record_id: str) -> Record | None:
        row = await self._run(
            lambda: self._connection.execute(
                "SELECT * FROM records WHERE kind = ? AND id = ?", (kind, record_id)
            ).fetchone()
        )
        return _record(row) if row else None

    async def delete(self, kind: str, record_id: str) -> bool:
        cursor = await self._run(
            lambda: self._connection.execute("DELETE FROM records WHERE kind = ? AND id = ?", (kind, record_id))
        )
        return cursor.rowcount > 0

    async def page(
        self,
        kind: str,
        owner: str | None,
        after: str | None = None,
        limit: int = 20,
        order: Order = "asc",
        match: Callable[[Record], bool] | None = None,
    ) -> Page:
        return await self._run(lambda: self._page(kind, owner, after, limit, order, match))

    def _page(
        self,
        kind: str,
        owner: str | None,
        after: str | None,
        limit: int,
        order: Order,
        match: Callable[[Record], bool] | None,
    ) -> Page:
        found = []
        for record in self._scan(kind, owner, after, order):
            if match is None or match(record):
                if len(found) == limit:
                    return Page(found, True)
                found.append(record)
        return Page(found, False)

    def _scan(self, kind: str, owner: str | None, after: str | None, order: Order) -> Iterator[Record]:
        """Records of `owner` (any when None) in list order after the record `after`."""
        position = None
        if after is not None:
            position = self._connection.execute(
                "SELECT created, id FROM records WHERE kind = ? AND id = ?", (kind, after)
            ).fetchone()
            if position is None:
                return
        beyond, direction = (">", "ASC") if order == "asc" else ("<", "DESC")
        while True:
            where, params = ["kind = ?"], [kind]
            if owner is not None:
                where.append("owner = ?")
                params.append(owner)
            if position is not None:
                where.append(f"(created, id) {beyond} (?, ?)")
                params += position
            rows = self._connection.execute(
                f"SELECT * FROM records WHERE {' AND '.join(where)} ORDER BY created {direction}, id {direction}"
                f" LIMIT {SCAN_ROWS}",
                params,
            ).fetchall()
            for row in rows:
                yield _record(row)
            if len(rows) < SCAN_ROWS:
                return
            position = (rows[-1][3], rows[-1][1])

    async def claim(self, kind: str, record_id: str, holder: str, lease_s: float) -> bool:
        def take() -> bool:
            now = time.time()
            cursor = self._connection.execute(
                "INSERT INTO leases VALUES (?, ?, ?, ?) ON CONFLICT (kind, id) DO UPDATE SET"
                " holder = excluded.holder, until = excluded.until WHERE holder = excluded.holder OR until < ?",
                (kind, record_id, holder, now + lease_s, now),
            )
            return cursor.rowcount > 0

        return await self._run(take)

    async def release(self, kind: str, record_id: str, holder: str) -> None:
        await self._run(
            lambda: self._connection.execute(
                "DELETE FROM leases WHERE kind = ? AND id = ? AND holder = ?", (kind, record_id, holder)
            )
        )

    async def close(self) -> None:
        await self._run(self._connection.close)
        self._executor.shutdown()
