"""The router side of the simulation: the router's own Membership, Balancer and policies, fed with
the simulated workers' load reports, and the failover of streams from failed workers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from msgspec.structs import replace
from prometheus_client import CollectorRegistry

from shoal.engine.sequence import Sequence
from shoal.protocol.admission_class import PRIORITY_HEADER
from shoal.router.config import HealthSettings
from shoal.router.fleet.followed_caches import FollowedCaches
from shoal.router.fleet.health_events import HealthEvents
from shoal.router.placement.balancer import Balancer, Placement
from shoal.router.placement.latency_targets import TPOT_HEADER, TTFT_HEADER, late, with_targets
from shoal.router.placement.policies import make_policy
from shoal.router.placement.route_request import route_request
from shoal.router.views import RouteRequest
from shoal.simulate.events import EventLoop
from shoal.simulate.membership import CachedMembership
from shoal.simulate.tokens import SimRequest
from shoal.simulate.worker import SimWorker

MODEL = "sim"
SHED = "shed: no worker can meet its latency targets"
# The golden ratio's fraction: request i is sheddable when (i x this) mod 1 falls below the share,
# which spreads the sheddable ones evenly over the workload.
SPREAD = 0.6180339887498949


@dataclass(frozen=True)
class RouterSettings:
    """The router's settings that matter here, with the router's defaults: its policy, how it
    estimates tokens from characters and output length, how often each worker's load report
    arrives, and how many times a stream may move before it fails. With `kv_event_lag_s` the workers
    publish KV events and the router follows them, reading each worker's new ones every that many
    seconds (staggered); without it the router guesses what each caches. `routers` independent
    routers (not a router group: each knows only what it placed) take the requests in turn, as
    behind a plain load balancer; each hears every worker's reports (and they share one follower
    per worker of its events, whose states they would hold equal).

    With `ttft_target_ms` or `tpot_target_ms` every request carries those latency targets (the
    headers), and `sheddable_share` of them (spread evenly) are sheddable: the router refuses one at
    once where no worker is predicted to meet them. With `read_targets` off the router is not told
    the targets (no target placement, no shedding); they still say which requests met them."""

    policy: str = "cost"
    chars_per_token: float = 4.0
    default_decode_tokens: int = 256
    report_interval_s: float = 0.5
    max_migrations: int = 3
    kv_event_lag_s: float | None = None
    routers: int = 1
    ttft_target_ms: float | None = None
    tpot_target_ms: float | None = None
    sheddable_share: float = 0.0
    read_targets: bool = True

    @property
    def has_targets(self) -> bool:
        return bool(self.ttft_target_ms or self.tpot_target_ms)

    def headers(self, index: int) -> dict[str, str]:
        """What request `index` sends besides its body: its targets, and whether it is sheddable."""
        headers = {}
        if self.ttft_target_ms:
            headers[TTFT_HEADER] = str(self.ttft_target_ms)
        if self.tpot_target_ms:
            headers[TPOT_HEADER] = str(self.tpot_target_ms)
        if (index * SPREAD) % 1 < self.sheddable_share:
            headers[PRIORITY_HEADER] = "sheddable"
        return headers


@dataclass
class Flight:
    """One request from the router's point of view. `cached_tokens` is what its first worker found
    in its prefix cache; `lost_tokens` the KV tokens computed for it on workers that then failed;
    `recomputed_tokens` those of them computed again where it resumed (what the new worker's cache
    did not hold). `routed` is what the router placed; `scored` the request with the targets its
    client sent, whether or not the router read them."""

    request: SimRequest
    routed: RouteRequest
    scored: RouteRequest
    sent_s: float
    balancer: Balancer
    placement: Placement | None = None
    failed_on: set[str] = field(default_factory=set)
    first_token_s: float | None = None
    cached_tokens: int | None = None
    migrations: int = 0
    lost_tokens: int = 0
    recomputed_tokens: int = 0
    pending_recompute: int = 0


class SimRouter:
    """Places requests exactly as the router's Balancer does (eligible workers, the policy's
    choice, prefix index and in-flight accounting), over WorkerState records that receive each
    worker's load report every `report_interval_s` (staggered), as from heartbeats.

    A failed worker is down at once (its streams break), leaves the prefix index, and each of its
    requests resumes elsewhere from its prompt and the tokens generated so far, never on a worker
    that failed it, at most `max_migrations` times. Invariant: every request in `flights` holds
    exactly one placement, on the worker running it."""

    def __init__(
        self, settings: RouterSettings, loop: EventLoop, seed: int, on_done: Callable[[Flight, str | None], None]
    ):
        self.settings = settings
        self.loop = loop
        self.on_done = on_done
        self.balancers = [
            Balancer(
                make_policy(settings.policy),
                CachedMembership(HealthSettings(), HealthEvents(CollectorRegistry())),
                seed + number,
                clock=lambda: loop.now,
            )
            for number in range(settings.routers)
        ]
        self.workers: dict[str, SimWorker] = {}
        self.flights: dict[str, Flight] = {}
        self.followed = FollowedCaches()
        for balancer in self.balancers:
            if settings.kv_event_lag_s is not None:
                balancer.followed = self.followed

    def join(self, worker: SimWorker, report_phase_s: float) -> None:
        """Registers a worker; its reports (and its KV events, when followed) arrive from
        `report_phase_s` on."""
        self.workers[worker.spec.worker_id] = worker
        for balancer in self.balancers:
            balancer.membership.register(worker.spec.worker_id, [MODEL], worker.load_report())
        self.loop.after(report_phase_s, self._report, worker)
        if self.settings.kv_event_lag_s is not None:
            self.loop.after(
                report_phase_s * self.settings.kv_event_lag_s / self.settings.report_interval_s, self._follow, worker
            )

    def _follow(self, worker: SimWorker) -> None:
        """Applies the worker's events published since the last read (a snapshot where they do not
        follow: the first read, a restarted worker)."""
        feed, log = self.followed.feed(worker.spec.worker_id), worker.events
        frame = log.read(feed.seq) if feed.epoch == log.epoch and feed.seq >= 0 else None
        if frame is None or not feed.apply(frame, self.loop.now):
            feed.apply(log.snapshot(), self.loop.now)
        self.loop.after(self.settings.kv_event_lag_s, self._follow, worker)

    def _report(self, worker: SimWorker) -> None:
        if worker.up:
            report = worker.load_report()
            for balancer in self.balancers:
                balancer.membership.heartbeat(worker.spec.worker_id, report)
        self.loop.after(self.settings.report_interval_s, self._report, worker)

    def submit(self, request: SimRequest, sent_s: float) -> None:
        """A request reaches the router (the client sent it at `sent_s`)."""
        headers = self.settings.headers(request.index)
        scored = with_targets(
            route_request(
                request.body(MODEL), headers, True, self.settings.chars_per_token, self.settings.default_decode_tokens
            ),
            headers,
        )
        routed = scored if self.settings.read_targets else replace(scored, ttft_target_s=None, tpot_target_s=None)
        balancer = self.balancers[request.index % len(self.balancers)]
        flight = self.flights[str(request.index)] = Flight(request, routed, scored, sent_s, balancer)
        if late(routed, balancer.best_estimate):
            self._end(flight, SHED)
            return
        self._send(flight, request.prompt_token_ids(), [])

    def _send(self, flight: Flight, prompt: list[int], resumed: list[int]) -> None:
        placement = flight.balancer.place(flight.routed, exclude=frozenset(flight.failed_on))
        if placement is None:
            self._end(flight, "no worker can take the request")
            return
        worker = self.workers[placement.worker.worker_id]
        flight.placement = placement
        if len(prompt) + len(resumed) > worker.max_prompt_tokens:  # the worker answers 400
            self._release(flight)
            self._end(flight, "the prompt is too long for the worker")
            return
        flight.balancer.membership.changed(worker.spec.worker_id)
        request = flight.request
        prefix = (request, flight.routed.prefix_blocks)
        worker.add(str(request.index), prompt, resumed, request.max_tokens, request.output_token_id(0), prefix)

    def first_token(self, worker_id: str, seq: Sequence) -> None:
        flight = self.flights[seq.request_id]
        flight.placement.worker.first_byte(flight.placement.ticket)
        flight.balancer.membership.changed(worker_id)
        if flight.first_token_s is None:
            flight.first_token_s, flight.cached_tokens = self.loop.now, seq.num_cached_tokens
        flight.recomputed_tokens += max(0, flight.pending_recompute - seq.num_cached_tokens)
        flight.pending_recompute = 0

    def finished(self, worker_id: str, seq: Sequence, error: str | None) -> None:
        flight = self.flights[seq.request_id]
        self._release(flight)
        self._end(flight, error)

    def _release(self, flight: Flight) -> None:
        flight.balancer.release(flight.placement)
        flight.balancer.membership.changed(flight.placement.worker.worker_id)

    def _end(self, flight: Flight, error: str | None) -> None:
        del self.flights[str(flight.request.index)]
        self.on_done(flight, error)

    def worker_failed(self, worker: SimWorker) -> None:
        worker_id = worker.spec.worker_id
        for balancer in self.balancers:
            state = balancer.membership.workers[worker_id]
            state.down, state.down_since = True, self.loop.now
            balancer.membership.changed(worker_id)
            balancer.forget(worker_id)  # it restarts with an empty cache
        for seq in worker.fail():
            flight = self.flights[seq.request_id]
            self._release(flight)
            flight.placement = None
            flight.failed_on.add(worker_id)
            flight.lost_tokens += seq.num_computed_tokens
            flight.migrations += 1
            if flight.migrations > self.settings.max_migrations:
                self._end(flight, f"failed over {self.settings.max_migrations} times")
                continue
            flight.pending_recompute = seq.num_computed_tokens
            self._send(flight, seq.prompt_token_ids, list(seq.output_token_ids))

    def worker_recovered(self, worker: SimWorker) -> None:
        worker.recover()
        report = worker.load_report()
        for balancer in self.balancers:
            state = balancer.membership.workers[worker.spec.worker_id]
            state.down, state.down_since = False, None
            balancer.membership.heartbeat(worker.spec.worker_id, report)
