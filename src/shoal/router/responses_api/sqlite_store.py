"""Stored responses in one SQLite file: embedded, the default, and kept across router restarts."""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from shoal.router.responses_api.store import StoredTurn, StoreUnavailable

T = TypeVar("T")

SYNCHRONOUS = {"full": "FULL", "normal": "NORMAL"}  # ResponsesSettings.sqlite_synchronous -> the pragma
SCHEMA = "CREATE TABLE IF NOT EXISTS responses (id TEXT PRIMARY KEY, turn TEXT NOT NULL) WITHOUT ROWID"


def _connect(path: Path, synchronous: str) -> sqlite3.Connection:
    path.parent.mkdir(parents=True, exist_ok=True)
    connection = sqlite3.connect(path, isolation_level=None, timeout=5.0)
    connection.execute("PRAGMA journal_mode=WAL")
    connection.execute(f"PRAGMA synchronous={SYNCHRONOUS[synchronous]}")
    connection.execute(SCHEMA)
    return connection


class SQLiteStore:
    """Invariants: the connection is only touched by the store's one thread, so the event loop never
    blocks on the file; each call is one autocommitted statement, so a turn is stored whole or not at
    all and outlives the process (WAL mode: readers do not wait for the writer, and routers on one
    host may share the file); with synchronous `full` it is on disk before `put` returns."""

    def __init__(self, executor: ThreadPoolExecutor, connection: sqlite3.Connection):
        self._executor = executor
        self._connection = connection

    @classmethod
    async def open(cls, path: str | Path, synchronous: str = "full") -> SQLiteStore:
        """Opens (creating the file and its directory if needed) the store at `path` (`~` expanded)."""
        executor = ThreadPoolExecutor(1, thread_name_prefix="shoal-responses-sqlite")
        connection = await asyncio.get_running_loop().run_in_executor(
            executor, _connect, Path(path).expanduser(), synchronous
        )
        return cls(executor, connection)

    async def _run(self, call: Callable[[], T]) -> T:
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, call)
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"the SQLite response store failed: {exc}") from exc

    async def put(self, turn: StoredTurn) -> None:
        text = turn.to_json()
        await self._run(
            lambda: self._connection.execute(
                "INSERT OR REPLACE INTO responses (id, turn) VALUES (?, ?)", (turn.response_id, text)
            )
        )

    async def get(self, response_id: str) -> StoredTurn | None:
        row = await self._run(
            lambda: self._connection.execute("SELECT turn FROM responses WHERE id = ?", (response_id,)).fetchone()
        )
        return StoredTurn.from_json(row[0]) if row else None

    async def delete(self, response_id: str) -> bool:
        cursor = await self._run(lambda: self._connection.execute("DELETE FROM responses WHERE id = ?", (response_id,)))
        return cursor.rowcount > 0

    async def close(self) -> None:
        await self._run(self._connection.close)
        self._executor.shutdown()
