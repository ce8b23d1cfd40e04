"""Runs batches on the capacity interactive traffic leaves idle, and finishes them.

A batch is run by one router at a time, under a lease (state.leased_work): one whose router died
is taken over once its lease runs out. A line's result is stored, under the line's number, the
moment it is known, and a batch's runner runs only the lines without one: a router restart loses
no finished line and no line gets two results. Its requests go through the front door in the
batch class: never queued, refused while anyone else waits, tried again after a pause. A batch
ends completed (every line has a result), cancelled or expired (its window passed: what finished
is reported, the rest fail as batch_cancelled or batch_expired); its output and error files are
then written and it is marked finished, in that order, so a batch taken over while finalising is
finalised again, to the same files."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

from shoal.router.admission.auth import ApiKeys, Client
from shoal.router.batch_api.batch_input import BatchLine, read_lines
from shoal.router.batch_api.batch_object import CANCEL_KIND, FINISHED, KIND
from shoal.router.config import BatchSettings
from shoal.router.files_api.file_store import FileStore
from shoal.router.state.leased_work import mark_finished
from shoal.router.state.records import Record, RecordStore, every_record

log = logging.getLogger(__name__)

RESULT_KIND = "batch_result"  # id BATCH_ID:LINE, owner the batch id, created_at the line number
# Serves one line: (endpoint, body, client) -> (HTTP status, JSON body, request id).
ServeLine = Callable[[str, dict, Client], Awaitable[tuple[int, dict, str | None]]]
RETRIED_STATUSES = (429, 503)  # no capacity for it now: the line waits and tries again
FLUSH_S = 0.5  # how often a running batch's counts are written and its cancel and window checked


def output_file_ids(batch_id: str) -> tuple[str, str]:
    """A batch's output and error file ids: the same whichever router writes them."""
    suffix = batch_id.removeprefix("batch_")
    return f"file-{suffix}-output", f"file-{suffix}-errors"


def _result(batch_id: str, line: BatchLine, ok: bool, output: dict) -> Record:
    return Record(RESULT_KIND, f"{batch_id}:{line.index}", batch_id, line.index, {"ok": ok, "line": output})


def _failure(line: BatchLine, error: dict) -> dict:
    return {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": line.custom_id, "response": None, "error": error}


@dataclass
class _Run:
    """A batch being run here: its stored state, its lines, and the line numbers with a result."""

    batch: Record
    lines: list[BatchLine]
    done: set[int]
    counts: dict[str, int] = field(default_factory=dict)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    cancelling_at: int | None = None  # set when the run stopped for a cancel


class BatchRunner:
    """Invariants: a batch runs here only while this router holds its lease (state.leased_work,
    which calls run_batch); at most `max_in_flight` batch requests are in flight from this router,
    whatever the number of batches; every result is stored before the counts that include it."""

    def __init__(self, files: FileStore, serve_line: ServeLine, api_keys: ApiKeys, settings: BatchSettings):
        self.files = files
        self.serve_line = serve_line
        self.api_keys = api_keys
        self.settings = settings
        self.in_flight = asyncio.Semaphore(settings.max_in_flight)

    @property
    def store(self) -> RecordStore:
        return self.files.records.store

    async def run_batch(self, batch_id: str) -> None:
        """Runs one batch to its end (LeasedWork calls it while this router holds the batch's lease)."""
        batch = await self.store.get(KIND, batch_id)
        if batch is None or batch.body["status"] in FINISHED:
            await mark_finished(self.store, KIND, batch_id)
            return
        client = self.api_keys.named(batch.owner)
        if client is None:
            await self._fail(
                batch, "invalid_api_key", f"the API key {batch.owner!r} that created it is no longer valid"
            )
            return
        try:
            content = await self.files.read(batch.body["input_file_id"])
        except FileNotFoundError:
            await self._fail(batch, "missing_file", "its input file was deleted before the batch ran", "input_file_id")
            return
        lines = await asyncio.to_thread(read_lines, content, batch.body["endpoint"])
        run = _Run(batch, lines, set(), {"total": len(lines), "completed": 0, "failed": 0})
        await self._count_results(run)
        if batch.body["status"] == "validating":
            for line in lines:
                if line.error is not None and line.index not in run.done:
                    await self._record(run, line, False, _failure(line, line.error))
            await self._save(run, status="in_progress", in_progress_at=int(time.time()))
        pending = asyncio.Queue()
        for line in lines:
            if line.body is not None and line.index not in run.done:
                pending.put_nowait(line)
        if not await self._should_stop(run):  # a batch found cancelled or expired runs nothing more
            watcher = asyncio.create_task(self._watch(run))
            try:
                await asyncio.gather(*(self._serve(run, pending, client) for _ in range(self.settings.max_in_flight)))
            finally:
                watcher.cancel()
                await asyncio.gather(watcher, return_exceptions=True)
        await self._finalize(run)

    async def _count_results(self, run: _Run) -> None:
        """The lines that already have a result (stored by this batch's earlier runners)."""
        async for result in every_record(self.store, RESULT_KIND, run.batch.id):
            run.done.add(int(result.created_at))
            run.counts["completed" if result.body["ok"] else "failed"] += 1

    async def _serve(self, run: _Run, pending: asyncio.Queue, client: Client) -> None:
        while not run.stop.is_set() and not pending.empty():
            line = pending.get_nowait()
            while True:
                async with self.in_flight:
                    status, body, request_id = await self.serve_line(run.batch.body["endpoint"], line.body, client)
                if status not in RETRIED_STATUSES:
                    break
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(run.stop.wait(), self.settings.retry_s)
                if run.stop.is_set():
                    return
            response = {"status_code": status, "request_id": request_id, "body": body}
            output = {"id": f"batch_req_{secrets.token_hex(12)}", "custom_id": line.custom_id, "response": response}
            await self._record(run, line, 200 <= status < 300, {**output, "error": None})

    async def _record(self, run: _Run, line: BatchLine, ok: bool, output: dict) -> None:
        await self.store.put(_result(run.batch.id, line, ok, output))
        run.done.add(line.index)
        run.counts["completed" if ok else "failed"] += 1

    async def _watch(self, run: _Run) -> None:
        """Writes the counts, and stops the run when a cancel is asked for or the window passes."""
        written = None
        while True:
            await asyncio.sleep(FLUSH_S)
            if run.counts != written:
                written = dict(run.counts)
                await self._save(run)
            if await self._should_stop(run):
                return

    async def _should_stop(self, run: _Run) -> bool:
        """Whether the batch was cancelled or its window passed (then `run.stop` is set)."""
        cancel = await self.store.get(CANCEL_KIND, run.batch.id)
        if cancel is not None or time.time() >= run.batch.body["expires_at"]:
            run.cancelling_at = cancel.body["cancelling_at"] if cancel is not None else None
            run.stop.set()
        return run.stop.is_set()

    async def _save(self, run: _Run, **changes) -> None:
        body = {**run.batch.body, "request_counts": dict(run.counts), **changes}
        run.batch = Record(KIND, run.batch.id, run.batch.owner, run.batch.created_at, body)
        await self.store.put(run.batch)

    async def _finalize(self, run: _Run) -> None:
        if len(run.done) == len(run.lines):
            ending, changes = "completed", {}
        elif run.cancelling_at is not None:
            ending, changes = "cancelled", {"cancelling_at": run.cancelling_at}
        else:
            ending, changes = "expired", {}
        await self._save(run, status="finalizing", finalizing_at=int(time.time()))
        outputs, errors = await self._outputs(run, ending)
        output_id, error_id = output_file_ids(run.batch.id)
        for file_id, kept, name in ((output_id, outputs, "output"), (error_id, errors, "errors")):
            if kept:
                data = b"".join(json.dumps(line).encode() + b"\n" for line in kept)
                await self.files.save(
                    run.batch.owner, f"{run.batch.id}_{name}.jsonl", "batch_output", _once(data), file_id
                )
        await self._save(
            run,
            status=ending,
            output_file_id=output_id if outputs else None,
            error_file_id=error_id if errors else None,
            **changes,
            **{f"{ending}_at": int(time.time())},
        )
        await mark_finished(self.store, KIND, run.batch.id)
        log.info("batch %s %s: %s", run.batch.id, ending, run.counts)

    async def _outputs(self, run: _Run, ending: str) -> tuple[list[dict], list[dict]]:
        """Every line's result in line order, split into successes and failures; a line without
        one (the batch was cancelled or expired) fails as batch_cancelled or batch_expired."""
        results = {int(r.created_at): r.body async for r in every_record(self.store, RESULT_KIND, run.batch.id)}
        outputs, errors = [], []
        code = f"batch_{ending}"
        for line in run.lines:
            result = results.get(line.index)
            if result is None:
                message = f"the batch was {ending} before this request ran"
                errors.append(_failure(line, {"code": code, "message": message}))
                run.counts["failed"] += 1
            else:
                (outputs if result["ok"] else errors).append(result["line"])
        return outputs, errors

    async def _fail(self, batch: Record, code: str, message: str, param: str | None = None) -> None:
        error = {"code": code, "message": message, "param": param, "line": None}
        body = {
            **batch.body,
            "status": "failed",
            "failed_at": int(time.time()),
            "errors": {"object": "list", "data": [error]},
        }
        await self.store.put(Record(KIND, batch.id, batch.owner, batch.created_at, body))
        await mark_finished(self.store, KIND, batch.id)


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data
