"""One worker as the router sees it: what it was sent and has not finished (InFlight), its last
load report, contact and health marks, its breaker, what the router measures on the streams it
relays there, and the view routing policies read (WorkerView), rebuilt only when it changed."""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from msgspec.structs import replace

from shoal.router.fleet.circuit_breaker import CircuitBreaker
from shoal.router.fleet.latency_stats import LatencyStats
from shoal.router.fleet.load_report import LoadReport
from shoal.router.fleet.served_concurrency import ServedConcurrency
from shoal.router.load_figures import figures_of
from shoal.router.views import WorkerView, serves

NO_REPORT = LoadReport()  # what a worker that has not reported yet shows


class OpenUpstream(Protocol):
    """A response open on a worker (shoal.router.streams.upstream_client.UpstreamResponse)."""

    def close(self) -> None: ...


@dataclass
class InFlight:
    """Work the router sent and has not seen finish: prefill until the first byte, then decode."""

    prefill_tokens: int
    decode_tokens: int
    sent_at: float
    computed_tokens: int  # of its prompt, what the worker was expected to compute (prefill_tokens until the first byte)
    serving: bool = False  # its first token arrived


@dataclass
class WorkerState:
    """Mutable record of one worker. Invariants: `in_flight` holds exactly the requests this router
    has sent to it whose responses have not ended, in the order sent, and `prefill_tokens` and
    `decode_tokens` are their sums (kept as they change, so a view costs the same however busy the
    worker); `streams` the upstream responses open on it now; `elsewhere` what the other members of a
    router group last said they have in flight on it (requests, prefill tokens, decode tokens), summed
    in `elsewhere_total`; `down_since` is set exactly when `down`; `refused_at` is when a poll last
    found nobody listening."""

    worker_id: str
    url: str
    base_models: frozenset[str]  # as registered or listed; `models` adds the LoRA adapters it holds
    breaker: CircuitBreaker
    registered: bool = False
    # LoRA adapters its /v1/models lists (a card with a parent: how vLLM lists them), for a server
    # whose load report does not name its adapters.
    listed_adapters: frozenset[str] = frozenset()
    load_source: str | None = None  # "shoal", "prometheus" or "router" once known
    report: LoadReport | None = None
    last_seen: float = field(default_factory=time.monotonic)
    down: bool = False
    down_since: float | None = None
    refused_at: float | None = None
    ejected_until: float | None = None
    ejections: int = 0
    lease_expires: float | None = None
    latency: LatencyStats = field(default_factory=LatencyStats)
    concurrency: ServedConcurrency = field(default_factory=ServedConcurrency)
    in_flight: dict[int, InFlight] = field(default_factory=dict)
    prefill_tokens: int = 0
    decode_tokens: int = 0
    elsewhere: dict[int, tuple[int, int, int]] = field(default_factory=dict)
    elsewhere_total: tuple[int, int, int] = (0, 0, 0)
    work_changed: Callable[[WorkerState], None] | None = None  # hears of every change to in_flight
    streams: set[OpenUpstream] = field(default_factory=set)  # from the request sent to its release
    _tickets: itertools.count = field(default_factory=itertools.count)
    _base_view: WorkerView | None = field(default=None, repr=False)
    _base_key: tuple = field(default=(), repr=False)
    _view: WorkerView | None = field(default=None, repr=False)
    _view_key: tuple = field(default=(), repr=False)

    @property
    def models(self) -> frozenset[str]:
        """The models it serves: its own, and the LoRA adapters its last load report (or its model
        list) names."""
        adapters = self.report.lora_adapters if self.report is not None else ()
        if not adapters and not self.listed_adapters:
            return self.base_models
        return self.base_models | frozenset(adapters) | self.listed_adapters

    def serves(self, model: str, loadable_of: str | None = None) -> bool:
        """Whether it serves `model`, or can load it first (a LoRA adapter of base `loadable_of`)."""
        return serves(model, loadable_of, self.models, self.report is not None and self.report.lora_on_demand)

    @property
    def engine(self) -> str | None:
        """The engine serving here: "shoal", or the family whose metrics it exposes ("vllm",
        "sglang", "llama.cpp"); None while unknown (or where it exposes no metrics we read)."""
        if self.load_source == "shoal":
            return "shoal"
        return self.report.engine if self.report is not None else None

    @property
    def reports_nothing(self) -> bool:
        """Neither a load report nor metrics we read: the router knows only what it relays there."""
        return self.load_source == "router"

    @property
    def role(self) -> str:
        """colocated, prefill or decode, as its last load report said."""
        return self.report.role if self.report is not None else "colocated"

    @property
    def available(self) -> bool:
        """May get new work: answering, not ejected, breaker letting requests through, not draining."""
        draining = self.report is not None and self.report.draining
        return not self.down and self.ejected_until is None and self.breaker.allows() and not draining

    def start(self, prefill_tokens: int, decode_tokens: int) -> int:
        ticket = next(self._tickets)
        self.in_flight[ticket] = InFlight(prefill_tokens, decode_tokens, time.monotonic(), prefill_tokens)
        self.prefill_tokens += prefill_tokens
        self.decode_tokens += decode_tokens
        self._work_changed()
        return ticket

    def first_byte(self, ticket: int) -> None:
        work = self.in_flight.get(ticket)
        if work is not None:
            self.prefill_tokens -= work.prefill_tokens
            work.prefill_tokens = 0
            self._work_changed()

    def first_token(self, ticket: int) -> None:
        """A stream's first token arrived: the server is serving it."""
        work = self.in_flight.get(ticket)
        if work is not None and not work.serving:
            work.serving = True
            self.concurrency.started(work.sent_at, work.computed_tokens, time.monotonic())

    def finish(self, ticket: int) -> None:
        work = self.in_flight.pop(ticket, None)
        if work is not None:
            if work.serving:
                self.concurrency.ended(work.sent_at, time.monotonic())
            self.prefill_tokens -= work.prefill_tokens
            self.decode_tokens -= work.decode_tokens
            self._work_changed()

    def _work_changed(self) -> None:
        if self.work_changed is not None:
            self.work_changed(self)

    def set_elsewhere(self, member: int, requests: int, prefill_tokens: int, decode_tokens: int) -> None:
        """What router group member `member` now has in flight here (zeros: nothing)."""
        if any((requests, prefill_tokens, decode_tokens)):
            self.elsewhere[member] = (requests, prefill_tokens, decode_tokens)
        else:
            self.elsewhere.pop(member, None)
        self.elsewhere_total = tuple(map(sum, zip((0, 0, 0), *self.elsewhere.values())))

    def sever(self) -> None:
        """Closes the connections of every request open on this worker, whether still waiting for its
        first byte or streaming, so each fails over now."""
        for upstream in list(self.streams):
            upstream.close()

    def expected_itl_s(self) -> float | None:
        """The gap between tokens a stream on this worker should see: measured, else reported."""
        report = self.report or NO_REPORT
        return self.latency.itl_s or report.decode_step_s or report.single_step_s

    def view(self) -> WorkerView:
        """Built again only when what it shows changed (a view costs more than the comparison): in
        two parts, what changes on every request sent or ended (the router's in-flight accounting)
        put over a copy of the rest, which changes with reports and health."""
        healthy = self.available
        unreported = self.reports_nothing
        base_key = (
            self.report,
            self.models,
            healthy,
            self.load_source,
            self.concurrency.most,
            self.concurrency.service_s,
            self.concurrency.prefill_tokens_per_s if unreported else None,
            self.latency.itl_s if unreported else None,
        )
        key = (
            len(self.in_flight),
            self.prefill_tokens,
            self.decode_tokens,
            self.elsewhere_total,
            # what it has been busy for grows with time: refreshed every quarter second
            int(time.monotonic() * 4) if unreported else None,
        )
        if self._base_view is None or self._base_key != base_key:
            self._base_view, self._base_key, self._view = self._build_base_view(healthy, unreported), base_key, None
        if self._view is None or self._view_key != key:
            report = self.report or NO_REPORT
            requests, prefill, decode = self.elsewhere_total
            self._view = replace(
                self._base_view,
                in_flight=len(self.in_flight) + requests,
                outstanding_prefill_tokens=max(self.prefill_tokens + prefill, report.outstanding_prefill_tokens or 0),
                outstanding_decode_tokens=max(self.decode_tokens + decode, report.outstanding_decode_tokens or 0),
                busy_s=self._busy_s() if unreported else None,
            )
            self._view_key = key
        return self._view

    def _build_base_view(self, healthy: bool, unreported: bool) -> WorkerView:
        """The view without the router's in-flight accounting (view() puts it over this). A server
        that reports nothing shows the speeds the router measured there (those it has): prefill from
        its first tokens, its step from the gap between tokens, its rate that step times the
        requests it has been seen serving at once."""
        figures = figures_of(self.report or NO_REPORT)
        if unreported:
            step_s = self.latency.itl_s
            figures.update(
                prefill_tokens_per_s=self.concurrency.prefill_tokens_per_s,
                decode_step_s=step_s,
                decode_tokens_per_s=self.concurrency.most / step_s if step_s else None,
            )
        return WorkerView(
            worker_id=self.worker_id,
            url=self.url,
            models=self.models,
            healthy=healthy,
            served_concurrency=self.concurrency.most if unreported else None,
            service_s=self.concurrency.service_s if unreported else None,
            **figures,
        )

    def _busy_s(self) -> float:
        """How long the oldest request in flight has been served: since it was sent, or since the
        previous one ended (a serial server takes the next one then); 0 with none in flight. The
        oldest is the first in `in_flight` (entries go in as they are sent)."""
        oldest = next(iter(self.in_flight.values()), None)
        return 0.0 if oldest is None else time.monotonic() - max(oldest.sent_at, self.concurrency.last_end)
