"""The LoRA adapters a router loads on demand: each by name, with its base model and where workers
read it (a path under their `lora_dir`: a directory they share, or the same copy on each) and its
SHA-256 where given. Operators add them by loading an adapter through the router; they are kept in
the state store, so the routers of a group and a router that restarts know them, and a worker that
restarts or joins is given an adapter when a request first needs it there.

Placement charges a worker that does not hold an adapter the time to read it (policies.cost); once a
request is placed on such a worker, `ensure` loads the adapter there before the request is sent.
Concurrent requests for one adapter on one worker share one load."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass

import aiohttp

from shoal.router.fleet.membership import Membership
from shoal.router.fleet.worker_state import WorkerState
from shoal.router.state.open_records import SharedRecords
from shoal.router.state.records import Record, StoreUnavailable

log = logging.getLogger(__name__)

LORA_KIND = "lora_adapter"
FLEET_OWNER = "fleet"
LOAD_PATH = "/v1/load_lora_adapter"


@dataclass(frozen=True)
class AdapterSource:
    """Where workers of `base` read the adapter: `lora_path` under their lora_dir, checked against
    `sha256` where given."""

    base: str
    lora_path: str
    sha256: str | None = None

    def load_body(self, name: str) -> dict:
        body = {"lora_name": name, "lora_path": self.lora_path}
        return body | {"sha256": self.sha256} if self.sha256 else body


class AdapterLoadFailed(Exception):
    """A worker could not load an adapter (the message says what it answered)."""


class LoraCatalog:
    """Invariant: `sources` holds what this router added or removed, and what it read from the store
    for a name it was asked about; a name removed by another router of the group is forgotten here
    when a load of it fails (the worker's answer) or at restart."""

    def __init__(self, records: SharedRecords, membership: Membership, secret: str | None):
        self.records = records
        self.membership = membership
        self.secret = secret
        self.sources: dict[str, AdapterSource] = {}
        self._loads: dict[tuple[str, str], asyncio.Future] = {}

    async def add(self, name: str, source: AdapterSource) -> None:
        """Catalogued here at once, and in the store where it can be written (else logged)."""
        self.sources[name] = source
        body = {"base": source.base, "lora_path": source.lora_path, "sha256": source.sha256}
        try:
            await self.records.store.put(Record(LORA_KIND, name, FLEET_OWNER, time.time(), body))
        except StoreUnavailable as exc:
            log.warning("LoRA adapter %s catalogued by this router only: the state store failed (%s)", name, exc)

    async def remove(self, name: str) -> None:
        self.sources.pop(name, None)
        try:
            await self.records.store.delete(LORA_KIND, name)
        except StoreUnavailable as exc:
            log.warning("LoRA adapter %s left in the state store, which failed (%s)", name, exc)

    async def find(self, name: str) -> AdapterSource | None:
        """The adapter's source: known here, else read from the store (another router added it, or
        this one before a restart); None for a name that is no adapter of the catalog."""
        source = self.sources.get(name)
        if source is not None:
            return source
        try:
            record = await self.records.store.get(LORA_KIND, name)
        except StoreUnavailable:
            return None
        if record is None:
            return None
        source = AdapterSource(record.body["base"], record.body["lora_path"], record.body.get("sha256"))
        self.sources[name] = source
        return source

    async def ensure(self, worker: WorkerState, name: str) -> None:
        """The adapter served by `worker` once this returns: loaded there now unless its load
        report names it, then the report read again; AdapterLoadFailed otherwise."""
        if name in worker.models:
            return
        key = (worker.worker_id, name)
        load = self._loads.get(key)
        if load is None:
            load = self._loads[key] = asyncio.ensure_future(self._load(worker, name))
            load.add_done_callback(lambda _: self._loads.pop(key, None))
        await asyncio.shield(load)

    async def _load(self, worker: WorkerState, name: str) -> None:
        source = self.sources.get(name)
        if source is None:
            raise AdapterLoadFailed(f"no LoRA adapter named {name!r} is in the catalog")
        started = time.monotonic()
        result = await passed_on(self.membership.session, [worker], LOAD_PATH, source.load_body(name), self.secret)
        status, answer = result[worker.worker_id]["status"], result[worker.worker_id]["answer"]
        if status != 200:
            raise AdapterLoadFailed(f"answered {status}: {_message(answer)}")
        log.info("loaded LoRA adapter %s on %s in %.3f s", name, worker.worker_id, time.monotonic() - started)
        await self.membership.poll(worker)


async def passed_on(
    session: aiohttp.ClientSession, workers: list[WorkerState], path: str, body: dict, secret: str | None
) -> dict[str, dict]:
    """Each worker's status and answer to the change, by worker id."""
    headers = {"authorization": f"Bearer {secret}"} if secret else {}

    async def one(state: WorkerState) -> tuple[str, dict]:
        try:
            async with session.post(
                state.url + path, json=body, headers=headers, timeout=aiohttp.ClientTimeout(120)
            ) as response:
                text = await response.text()
                try:
                    answer = json.loads(text)
                except ValueError:
                    answer = text
                return state.worker_id, {"status": response.status, "answer": answer}
        except (aiohttp.ClientError, TimeoutError) as exc:
            return state.worker_id, {"status": 502, "answer": f"{type(exc).__name__}: {exc}"}

    return dict(await asyncio.gather(*(one(state) for state in workers)))


def _message(answer: dict | str) -> str:
    """The error message of a worker's answer (OpenAI's error shape), else the answer's start."""
    try:
        return answer["error"]["message"]
    except (KeyError, TypeError):
        return str(answer)[:200]
