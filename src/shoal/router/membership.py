"""Which workers the router knows, what each is doing, and whether it may get work.

Workers come from the static list (polled for load) or register themselves (and then push their
load in heartbeats; a worker whose lease runs out is dropped). Load comes from shoal's /load, else
from Prometheus metrics of other servers, else from the router's own accounting alone.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp

from shoal.router.load_report import LoadReport
from shoal.router.views import WorkerView

log = logging.getLogger(__name__)


@dataclass
class InFlight:
    """Work the router sent and has not seen finish: prefill until the first byte, then decode."""

    prefill_tokens: int
    decode_tokens: int


@dataclass
class WorkerState:
    """Mutable record of one worker. Invariant: `in_flight` holds exactly the requests this router
    has sent to it whose responses have not ended."""

    worker_id: str
    url: str
    models: frozenset[str]
    registered: bool = False
    load_source: str | None = None  # "shoal", "prometheus" or "router" once known
    report: LoadReport | None = None
    healthy: bool = True
    failures: int = 0
    lease_expires: float | None = None
    in_flight: dict[int, InFlight] = field(default_factory=dict)
    _tickets: itertools.count = field(default_factory=itertools.count)

    def start(self, prefill_tokens: int, decode_tokens: int) -> int:
        ticket = next(self._tickets)
        self.in_flight[ticket] = InFlight(prefill_tokens, decode_tokens)
        return ticket

    def first_byte(self, ticket: int) -> None:
        if ticket in self.in_flight:
            self.in_flight[ticket].prefill_tokens = 0

    def finish(self, ticket: int) -> None:
        self.in_flight.pop(ticket, None)

    def view(self) -> WorkerView:
        report = self.report or LoadReport()
        prefill = sum(f.prefill_tokens for f in self.in_flight.values())
        decode = sum(f.decode_tokens for f in self.in_flight.values())
        return WorkerView(
            worker_id=self.worker_id, url=self.url, models=self.models,
            healthy=self.healthy and not report.draining, running=report.running, waiting=report.waiting,
            max_num_seqs=report.max_num_seqs, in_flight=len(self.in_flight),
            outstanding_prefill_tokens=max(prefill, report.outstanding_prefill_tokens or 0),
            outstanding_decode_tokens=max(decode, report.outstanding_decode_tokens or 0),
            free_kv_tokens=report.free_kv_tokens, kv_capacity_tokens=report.kv_capacity_tokens,
            max_model_len=report.max_model_len, prefill_tokens_per_s=report.prefill_tokens_per_s,
            decode_tokens_per_s=report.decode_tokens_per_s, decode_step_s=report.decode_step_s,
            single_step_s=report.single_step_s, capability=report.capability)


def normalize_url(url: str) -> str:
    return url.rstrip("/")


class Membership:
    """Invariant: worker ids are their normalized URLs, unique in `workers`."""

    def __init__(self, poll_interval_s: float = 0.5, unhealthy_after_failures: int = 3, lease_s: float = 3.0):
        self.session: aiohttp.ClientSession | None = None  # opened by the app's lifespan
        self.poll_interval_s = poll_interval_s
        self.unhealthy_after_failures = unhealthy_after_failures
        self.lease_s = lease_s
        self.workers: dict[str, WorkerState] = {}

    def models(self) -> set[str]:
        return {m for w in self.workers.values() for m in w.models}

    def views(self) -> list[WorkerView]:
        return [w.view() for w in self.workers.values()]

    async def add_static(self, url: str, models: list[str] | None = None) -> WorkerState:
        """Adds a polled worker; its models are asked from /v1/models unless given."""
        url = normalize_url(url)
        state = WorkerState(url, url, frozenset(models or ()))
        self.workers[url] = state
        if not models:
            await self._discover_models(state)
        await self.poll(state)
        return state

    def register(self, url: str, models: list[str], report: dict | None) -> WorkerState:
        """A worker announcing itself; it must then heartbeat within every lease."""
        url = normalize_url(url)
        state = self.workers.get(url) or WorkerState(url, url, frozenset(models), registered=True)
        state.models = frozenset(models)
        self.workers[url] = state
        self.heartbeat(url, report)
        log.info("worker registered: %s serving %s", url, sorted(models))
        return state

    def heartbeat(self, worker_id: str, report: dict | None) -> bool:
        state = self.workers.get(normalize_url(worker_id))
        if state is None:
            return False
        state.lease_expires = time.monotonic() + self.lease_s
        state.healthy, state.failures = True, 0
        if report is not None:
            state.report, state.load_source = LoadReport.from_shoal(report), "shoal"
        return True

    def mark_failed(self, worker_id: str, reason: str) -> None:
        """Passive detection: a request saw the worker fail (never for a 4xx). It gets no new work
        until a poll or heartbeat finds it healthy again."""
        state = self.workers.get(worker_id)
        if state is not None:
            if state.healthy:
                log.warning("worker %s failed a request (%s); no new work until it answers again", worker_id, reason)
            state.healthy = False
            state.failures += 1

    def remove(self, worker_id: str) -> WorkerState | None:
        return self.workers.pop(normalize_url(worker_id), None)

    async def _get(self, url: str) -> tuple[int, bytes]:
        async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=2)) as response:
            return response.status, await response.read()

    async def _discover_models(self, state: WorkerState) -> None:
        try:
            _, body = await self._get(state.url + "/v1/models")
            state.models = frozenset(m["id"] for m in json.loads(body)["data"])
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            log.warning("cannot list the models of %s: %s", state.url, exc)

    async def poll(self, state: WorkerState) -> None:
        """Refreshes one polled worker's load report and health."""
        try:
            report = await self._read_load(state)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            state.failures += 1
            if state.healthy and state.failures >= self.unhealthy_after_failures:
                state.healthy = False
                log.warning("worker %s unhealthy after %d failed polls: %s", state.url, state.failures, exc)
            return
        if not state.healthy:
            log.info("worker %s healthy again", state.url)
        state.report, state.healthy, state.failures = report, True, 0
        if not state.models:
            await self._discover_models(state)

    async def _read_load(self, state: WorkerState) -> LoadReport | None:
        if state.load_source in (None, "shoal"):
            status, body = await self._get(state.url + "/load")
            if status == 200:
                state.load_source = "shoal"
                return LoadReport.from_shoal(json.loads(body))
            state.load_source = "prometheus"
        if state.load_source == "prometheus":
            status, body = await self._get(state.url + "/metrics")
            report = LoadReport.from_prometheus(body.decode()) if status == 200 else None
            if report is not None:
                return report
            state.load_source = "router"
        # Only the router's own in-flight counts; still prove the server answers.
        status, _ = await self._get(state.url + "/v1/models")
        if status != 200:
            raise aiohttp.ClientError(f"/v1/models answered {status}")
        return None

    async def run(self, after_poll: Callable[[], None] | None = None) -> None:
        """Polls static workers and expires registered workers' leases, forever; `after_poll` runs
        after each round (capacity may have changed)."""
        while True:
            now = time.monotonic()
            for state in list(self.workers.values()):
                if state.registered and state.lease_expires is not None and state.lease_expires < now:
                    log.warning("worker %s missed its heartbeats; removed", state.url)
                    self.remove(state.worker_id)
            await asyncio.gather(*(self.poll(s) for s in list(self.workers.values()) if not s.registered))
            if after_poll:
                after_poll()
            await asyncio.sleep(self.poll_interval_s)
