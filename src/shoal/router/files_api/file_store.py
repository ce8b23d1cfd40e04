"""Uploaded files: a record in the state store, the content in the files directory."""

from __future__ import annotations

import asyncio
import os
import secrets
import time
from collections.abc import AsyncIterator
from pathlib import Path

from shoal.router.state.open_records import SharedRecords
from shoal.router.state.records import Record, owned_record

KIND = "file"


class FileTooLarge(Exception):
    """The upload passed the configured size limit (answered as 413)."""


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


class FileStore:
    """Invariants: a file's content is in `directory/ID`, written whole before its record is stored
    (a temporary name, then renamed), so a file that lists can be read; a deleted file's record goes
    first, then its content. Disk work runs off the event loop."""

    def __init__(self, records: SharedRecords, directory: str, max_bytes: int):
        self.records = records
        self.directory = Path(directory).expanduser()
        self.max_bytes = max_bytes

    def path(self, file_id: str) -> Path:
        return self.directory / file_id

    async def save(
        self, owner: str, filename: str, purpose: str, chunks: AsyncIterator[bytes], file_id: str | None = None
    ) -> Record:
        """Stores an upload (or an output the router wrote, under the `file_id` it chose); raises
        FileTooLarge past max_bytes, leaving nothing behind."""
        file_id = file_id or new_file_id()
        await asyncio.to_thread(self.directory.mkdir, parents=True, exist_ok=True)
        partial = self.directory / f".{file_id}.{secrets.token_hex(4)}.partial"
        size = 0
        handle = await asyncio.to_thread(open, partial, "wb")
        try:
            async for chunk in chunks:
                size += len(chunk)
                if size > self.max_bytes:
                    raise FileTooLarge(f"the file is larger than this router's limit of {self.max_bytes} bytes")
                await asyncio.to_thread(handle.write, chunk)
            await asyncio.to_thread(_sync_and_close, handle)
            await asyncio.to_thread(os.replace, partial, self.path(file_id))
        except BaseException:
            handle.close()
            partial.unlink(missing_ok=True)
            raise
        now = time.time()
        body = {
            "id": file_id,
            "object": "file",
            "bytes": size,
            "created_at": int(now),
            "filename": filename,
            "purpose": purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }
        record = Record(KIND, file_id, owner, now, body)
        await self.records.store.put(record)
        return record

    async def owned(self, file_id: str, owner: str) -> Record | None:
        return await owned_record(self.records.store, KIND, file_id, owner)

    async def read(self, file_id: str) -> bytes:
        return await asyncio.to_thread(self.path(file_id).read_bytes)

    async def delete(self, file_id: str) -> None:
        await self.records.store.delete(KIND, file_id)
        await asyncio.to_thread(self.path(file_id).unlink, missing_ok=True)


def _sync_and_close(handle) -> None:
    handle.flush()
    os.fsync(handle.fileno())
    handle.close()
