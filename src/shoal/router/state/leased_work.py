"""Work the routers of a group share through the state store: each unit (a batch, a background
response) is marked active when it is created; every router looks for active units every poll
interval and runs those whose lease it can take, renewing the lease while it runs them. One router
runs a unit at a time; a unit whose router died is taken over once its lease runs out."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import Awaitable, Callable

from shoal.router.state.open_records import SharedRecords
from shoal.router.state.records import Record, RecordStore, StoreUnavailable, every_record

log = logging.getLogger(__name__)

ACTIVE_OWNER = ""  # the owner of every active marker: one list per kind of work


def active_kind(kind: str) -> str:
    return f"{kind}_active"


async def mark_active(store: RecordStore, kind: str, work_id: str, created_at: float) -> None:
    """Offers a unit of work to the routers (after the unit itself is stored)."""
    await store.put(Record(active_kind(kind), work_id, ACTIVE_OWNER, created_at, {}))


async def mark_finished(store: RecordStore, kind: str, work_id: str) -> None:
    await store.delete(active_kind(kind), work_id)


class LeasedWork:
    """Invariants: `work(id)` runs here only while this router holds the unit's lease (renewed
    every third of lease_s; a lost lease cancels it), at most once at a time per unit; a unit's
    lease is given back when its run ends, so another router can go on at once (a run that ended
    without marking the unit finished is taken again at the next look)."""

    def __init__(
        self,
        records: SharedRecords,
        kind: str,
        work: Callable[[str], Awaitable[None]],
        lease_s: float,
        poll_interval_s: float,
    ):
        self.records = records
        self.kind = kind
        self.work = work
        self.lease_s = lease_s
        self.poll_interval_s = poll_interval_s
        self.holder = f"router-{secrets.token_hex(8)}"
        self.running: dict[str, asyncio.Task] = {}

    async def run(self) -> None:
        """The router's loop for this kind of work (a lifespan task)."""
        while True:
            try:
                await self.sweep()
            except StoreUnavailable as exc:
                log.warning("%s work waits for the state store: %s", self.kind, exc)
            await asyncio.sleep(self.poll_interval_s)

    async def sweep(self) -> None:
        """Takes every active unit whose lease is free."""
        store = self.records.store
        async for marker in every_record(store, active_kind(self.kind), ACTIVE_OWNER, 100):
            if marker.id not in self.running and await store.claim(self.kind, marker.id, self.holder, self.lease_s):
                task = asyncio.create_task(self._hold(marker.id))
                self.running[marker.id] = task
                task.add_done_callback(lambda _, work_id=marker.id: self.running.pop(work_id, None))

    async def close(self) -> None:
        """Stops the units run here and gives their leases back, for another router to go on."""
        tasks = list(self.running.values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def _hold(self, work_id: str) -> None:
        store = self.records.store
        run = asyncio.create_task(self.work(work_id))
        try:
            while not run.done():
                await asyncio.wait({run}, timeout=self.lease_s / 3)
                if not run.done() and not await store.claim(self.kind, work_id, self.holder, self.lease_s):
                    log.warning("%s %s: its lease was lost; another router goes on with it", self.kind, work_id)
                    run.cancel()
            await run
        except StoreUnavailable as exc:
            log.warning("%s %s stops here: the state store failed (%s)", self.kind, work_id, exc)
        except asyncio.CancelledError:
            run.cancel()
            await asyncio.gather(run, return_exceptions=True)
            raise
        except Exception:
            log.exception("%s %s failed on this router", self.kind, work_id)
        finally:
            with contextlib.suppress(StoreUnavailable):
                await asyncio.shield(store.release(self.kind, work_id, self.holder))
