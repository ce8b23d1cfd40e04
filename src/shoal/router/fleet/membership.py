"""Which workers the router knows, what each is doing, and whether it may get work.

Workers come from the static list (polled for load) or register themselves (and then push their
load in heartbeats). Load comes from shoal's /load, else from Prometheus metrics of other servers,
else from the router's own accounting alone. Whether a worker may get work is decided by the
health monitor (health_monitor.py) from the contact recorded here and the worker's breaker.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable

import aiohttp

from shoal.protocol.worker_load import WorkerLoad, decode_load
from shoal.router.config import HealthSettings
from shoal.router.fleet.circuit_breaker import BreakerState, CircuitBreaker
from shoal.router.fleet.health_events import HealthEvents
from shoal.router.fleet.load_report import LoadReport
from shoal.router.fleet.worker_state import WorkerState
from shoal.router.views import WorkerView

log = logging.getLogger(__name__)


def normalize_url(url: str) -> str:
    return url.rstrip("/")


class Membership:
    """Invariant: worker ids are their normalized URLs, unique in `workers`. Membership records
    contact (polls, heartbeats); the health monitor decides what contact means."""

    def __init__(self, settings: HealthSettings, events: HealthEvents, poll_interval_s: float = 0.5):
        self.session: aiohttp.ClientSession | None = None  # opened by the app's lifespan
        self.settings = settings
        self.events = events
        self.poll_interval_s = poll_interval_s
        self.workers: dict[str, WorkerState] = {}
        self.known_models: set[str] = set()  # every model a worker ever served here
        self.work_changed: Callable[[WorkerState], None] | None = None  # given to every worker's state
        self._polls: dict[str, asyncio.Task] = {}

    def models(self) -> set[str]:
        return {m for w in self.workers.values() for m in w.models}

    def adapter_base(self, model: str) -> str | None:
        """The base model of a worker whose load report names `model` as a LoRA adapter it serves."""
        for state in self.workers.values():
            named = state.report is not None and model in state.report.lora_adapters
            if (named or model in state.listed_adapters) and state.base_models:
                return min(state.base_models)
        return None

    def serving_counts(self, models: set[str]) -> dict[str, int]:
        """Per model, how many available workers serve it now."""
        return {m: sum(1 for w in self.workers.values() if w.available and m in w.models) for m in sorted(models)}

    def _set_models(self, state: WorkerState, models: frozenset[str]) -> None:
        state.base_models = models
        self.known_models |= models

    def views(self) -> list[WorkerView]:
        return [w.view() for w in self.workers.values()]

    def _new_state(self, url: str, models: frozenset[str], registered: bool) -> WorkerState:
        breaker_settings = self.settings.breaker

        def breaker_changed(old: BreakerState, new: BreakerState, reason: str) -> None:
            self.events.record(url, f"breaker_{new}", reason)

        breaker = CircuitBreaker(
            breaker_settings.failure_threshold, breaker_settings.open_s, breaker_settings.max_open_s, breaker_changed
        )
        return WorkerState(url, url, models, breaker, registered=registered, work_changed=self.work_changed)

    async def add_static(self, url: str, models: list[str] | None = None) -> WorkerState:
        """Adds a polled worker; its models are asked from /v1/models unless given."""
        url = normalize_url(url)
        state = self._new_state(url, frozenset(), registered=False)
        self._set_models(state, frozenset(models or ()))
        self.workers[url] = state
        if not models:
            await self._discover_models(state)
        await self.poll(state)
        return state

    def register(self, url: str, models: list[str], report: WorkerLoad | None) -> WorkerState:
        """A worker announcing itself; it must then heartbeat within every lease."""
        url = normalize_url(url)
        state = self.workers.get(url)
        if state is None:
            state = self.workers[url] = self._new_state(url, frozenset(), registered=True)
        self._set_models(state, frozenset(models))
        self.heartbeat(url, report)
        self.events.record(url, "registered", f"serving {', '.join(sorted(models))}")
        return state

    def heartbeat(self, worker_id: str, report: WorkerLoad | None) -> bool:
        state = self.workers.get(normalize_url(worker_id))
        if state is None:
            return False
        state.last_seen = time.monotonic()
        state.lease_expires = state.last_seen + self.settings.lease_s
        if report is not None:
            state.report, state.load_source = LoadReport.from_shoal(report), "shoal"
        return True

    def remove(self, worker_id: str) -> WorkerState | None:
        state = self.workers.pop(normalize_url(worker_id), None)
        poll = self._polls.pop(normalize_url(worker_id), None)
        if poll is not None:
            poll.cancel()
        return state

    async def _get(self, url: str) -> tuple[int, bytes]:
        timeout = aiohttp.ClientTimeout(total=self.settings.heartbeat_interval_s * self.settings.missed_heartbeats)
        async with self.session.get(url, timeout=timeout) as response:
            return response.status, await response.read()

    async def _discover_models(self, state: WorkerState) -> None:
        try:
            _, body = await self._get(state.url + "/v1/models")
            cards = json.loads(body)["data"]  # a LoRA adapter's card names its base as parent
            self._set_models(state, frozenset(m["id"] for m in cards if not m.get("parent")))
            state.listed_adapters = frozenset(m["id"] for m in cards if m.get("parent"))
        except (aiohttp.ClientError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            log.warning("cannot list the models of %s: %s", state.url, exc)

    async def poll(self, state: WorkerState) -> None:
        """Refreshes one polled worker's load report; an answer is contact (last_seen)."""
        try:
            report = await self._read_load(state)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            log.debug("poll of %s failed: %s", state.url, exc)
            if isinstance(exc, aiohttp.ClientConnectorError):
                state.refused_at = time.monotonic()
            return
        state.report, state.last_seen = report, time.monotonic()
        if not state.models:
            await self._discover_models(state)

    async def _read_load(self, state: WorkerState) -> LoadReport | None:
        """The worker's load from the first source that answered it, tried in order (shoal's /load,
        Prometheus metrics, none) until one does; once found, a source that fails is a failed poll,
        not a reason to take the worker for another kind of server. A server with no load source is
        asked again at every poll (a shoal worker still starting may answer /load only later)."""
        source = None if state.load_source == "router" else state.load_source
        if source in (None, "shoal"):
            status, body = await self._get(state.url + "/load")
            report = shoal_load_report(body) if status == 200 else None
            if report is not None:
                state.load_source = "shoal"
                return LoadReport.from_shoal(report)
            if source == "shoal":
                raise aiohttp.ClientError(f"/load answered {status} with no shoal load report")
        if source in (None, "prometheus"):
            status, body = await self._get(state.url + "/metrics")
            report = LoadReport.from_prometheus(body) if status == 200 else None
            if report is not None:
                state.load_source = "prometheus"
                return report
            if source == "prometheus":
                raise aiohttp.ClientError(f"/metrics answered {status} with none of the known metrics")
        # Only the router's own in-flight counts; still prove the server answers. /health, not
        # /v1/models: llama-cpp-python lists its models only between requests (under the lock its
        # generation holds), and has no /health route, so its 404 is the answer that proves it lives.
        status, _ = await self._get(state.url + "/health")
        if status not in (200, 404):
            raise aiohttp.ClientError(f"/health answered {status}")
        if state.load_source != "router":
            log.info(
                "%s reports no load the router reads (/load, /metrics): placed by its in-flight requests", state.url
            )
        state.load_source = "router"
        return None

    async def run(self) -> None:
        """Polls each static worker every poll interval, forever; a worker whose last poll has not
        answered yet is not polled again, so one hung worker delays nobody."""
        while True:
            for worker_id, state in list(self.workers.items()):
                poll = self._polls.get(worker_id)
                if not state.registered and (poll is None or poll.done()):
                    self._polls[worker_id] = asyncio.create_task(self.poll(state))
            await asyncio.sleep(self.poll_interval_s)


def shoal_load_report(body: bytes) -> WorkerLoad | None:
    """A shoal worker's load report, or None where the body is another server's /load answer."""
    try:
        report = decode_load(body)
    except ValueError:
        return None
    return report if report.server == "shoal" else None
