"""Decides which workers may get work, from everything the router learns about them.

Detection, in order of speed: a refused or lost connection marks a worker down at once; a worker
that has not answered a poll or sent a heartbeat for missed_heartbeats × heartbeat_interval_s is
down; passive failures (5xx, timeouts, failed streams, failed canaries; never 4xx) feed its circuit
breaker; a worker whose latency is an outlier against the workers running the same engine is
ejected for a while. A down or ejected worker's streams are severed so they migrate now rather than
at their token deadline. Down workers rejoin as soon as they answer again; ejected ones when their
ejection ends; open breakers half-open after their open time and close on a successful probe (the
canary, for shoal workers). Every change goes through HealthEvents.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import deque
from collections.abc import Callable

import aiohttp

from shoal.router.config import HealthSettings
from shoal.router.fleet.circuit_breaker import BreakerState
from shoal.router.fleet.health_events import HealthEvents
from shoal.router.fleet.latency_stats import LatencyStats
from shoal.router.fleet.load_report import LoadReport
from shoal.router.fleet.membership import Membership
from shoal.router.fleet.outlier_detection import expected_token_s, normalised, outliers
from shoal.router.fleet.worker_state import WorkerState

STALLS_KEPT = 16  # the router's own recent stalls, left out of its workers' silences

# The most a worker's canary endpoint accepts as its timeout.
CANARY_TIMEOUT_LIMIT_S = 300.0


class HealthMonitor:
    """Invariant: at most one canary per worker is in flight; a worker is `down` only between a
    recorded "down" event and the next "up" (or its removal)."""

    def __init__(
        self, membership: Membership, settings: HealthSettings, events: HealthEvents, forget: Callable[[str], None]
    ):
        self.membership = membership
        self.settings = settings
        self.events = events
        self.forget = forget
        self.next_outlier_check = 0.0
        self.next_canary: dict[str, float] = {}
        self.canaries: dict[str, asyncio.Task] = {}
        self.tick_s = settings.heartbeat_interval_s / 4
        self.last_check: float | None = None
        self.stalls: deque[tuple[float, float]] = deque(maxlen=STALLS_KEPT)  # (from, to): see check
        self.capacity_grew: Callable[[], None] = lambda: None  # set by run()

    # Passive detection, from the requests the router relays.

    def request_failed(self, state: WorkerState, reason: str, connection_lost: bool) -> None:
        now = time.monotonic()
        state.breaker.record_failure(reason, now)
        if connection_lost and not state.down:
            self._mark_down(state, reason, now)

    def request_succeeded(self, state: WorkerState) -> None:
        was_available = state.available
        state.breaker.record_success()
        if state.available and not was_available:  # a probe closed the breaker: queued requests may go
            self.capacity_grew()

    # The periodic check.

    async def run(self, capacity_grew: Callable[[], None]) -> None:
        """Checks every quarter heartbeat interval, forever; `capacity_grew` runs when a worker
        may have become available again (so queued requests are admitted)."""
        self.capacity_grew = capacity_grew
        while True:
            if self.check(time.monotonic()):
                capacity_grew()
            await asyncio.sleep(self.tick_s)

    def check(self, now: float) -> bool:
        """One round over the fleet; True when some worker may have become available. A round more
        than two ticks after the last one means the router itself stood still (a starved CPU, a
        long pause), when answers may have waited unread in its sockets: a worker's silence does
        not count the time the router stood still."""
        grew = False
        if self.last_check is not None and now - self.last_check > 2 * self.tick_s:
            self.stalls.append((self.last_check + self.tick_s, now))
        self.last_check = now
        # Less one tick, so that a silence is noticed within missed_heartbeats intervals, not after.
        silent_limit = self.settings.heartbeat_interval_s * self.settings.missed_heartbeats - self.tick_s
        for state in list(self.membership.workers.values()):
            if state.registered and state.lease_expires is not None and state.lease_expires < now:
                self._remove(state, f"no heartbeat for {self.settings.lease_s:g} s")
                continue
            silent = self._silence(state.last_seen, now)
            if not state.down and state.refused_at is not None and state.refused_at > state.last_seen:
                self._mark_down(state, "connection refused", now)
            elif not state.down and silent > silent_limit:
                self._mark_down(state, f"no answer for {silent:.1f} s", now)
            elif state.down and state.last_seen > state.down_since:
                # Latencies from before it went down (often the cause) must not eject it now.
                state.down, state.down_since, state.latency = False, None, LatencyStats()
                self.events.record(state.worker_id, "up", "answering again")
                grew = True
            was_open = state.breaker.state is BreakerState.OPEN
            state.breaker.tick(now)
            grew |= was_open and state.breaker.state is not BreakerState.OPEN
            if state.ejected_until is not None and now >= state.ejected_until:
                state.ejected_until, state.latency = None, LatencyStats()
                self.events.record(state.worker_id, "rejoined", "ejection ended")
                grew = True
            self._maybe_canary(state, now)
        if now >= self.next_outlier_check:
            self.next_outlier_check = now + self.settings.heartbeat_interval_s
            self._eject_outliers(now)
        return grew

    def _silence(self, since: float, now: float) -> float:
        """Seconds from `since` to `now` the router was awake for (the recent stalls left out)."""
        return now - since - sum(max(0.0, end - max(start, since)) for start, end in self.stalls)

    def _mark_down(self, state: WorkerState, reason: str, now: float) -> None:
        state.down, state.down_since = True, now
        self.events.record(state.worker_id, "down", reason)
        state.sever()

    def _remove(self, state: WorkerState, reason: str) -> None:
        self.membership.remove(state.worker_id)
        self.forget(state.worker_id)
        self.events.record(state.worker_id, "removed", reason)
        state.sever()

    # Gray failures.

    def _eject_outliers(self, now: float) -> None:
        """Per model, among the workers running the same engine: a shoal worker batching a dozen
        streams and a server that runs one at a time differ in inter-token latency by design."""
        settings = self.settings.outliers
        for model in self.membership.models():
            group = [s for s in self.membership.workers.values() if model in s.models and not s.down]
            budget = int(settings.max_ejected_fraction * len(group)) - sum(s.ejected_until is not None for s in group)
            serving = [s for s in group if s.ejected_until is None]
            for engine in sorted({s.engine or "" for s in serving}):
                budget = self._eject_among([s for s in serving if (s.engine or "") == engine], budget, now)

    def _eject_among(self, peers: list[WorkerState], budget: int, now: float) -> int:
        """Ejects the outliers among `peers`, at most `budget` of them; the budget left."""
        settings = self.settings.outliers
        steps = {s.worker_id: s.report.single_step_s if s.report else None for s in peers}
        token_gaps = {s.worker_id: _expected_token_s(s) for s in peers}
        typical_gaps = {
            s.worker_id: s.latency.typical_itl_s() for s in peers if s.latency.itl_samples >= settings.min_samples
        }
        first_tokens = {s.worker_id: s.latency.ttft_s for s in peers if s.latency.ttft_samples >= settings.min_samples}
        for label, measured, expected in (
            ("inter-token latency", typical_gaps, token_gaps),
            ("time to first token", first_tokens, steps),
        ):
            scores = normalised(measured, expected)
            for worker_id in sorted(
                outliers(scores, settings.factor, settings.min_workers), key=scores.get, reverse=True
            ):
                state = self.membership.workers[worker_id]
                if budget <= 0 or state.ejected_until is not None:
                    continue
                budget -= 1
                state.ejections += 1
                state.ejected_until = now + settings.ejection_s * state.ejections
                self.events.record(
                    worker_id,
                    "ejected",
                    f"{label} {measured[worker_id] * 1e3:.0f} ms, "
                    f"{scores[worker_id] / statistics.median(scores.values()):.1f}x the median of "
                    f"{len(scores)} workers" + (f" on {state.engine}" if state.engine else ""),
                )
                state.sever()
        return budget

    # Active probes: the canary generation of shoal workers.

    def _maybe_canary(self, state: WorkerState, now: float) -> None:
        if state.load_source != "shoal" or state.down:
            return
        running = self.canaries.get(state.worker_id)
        if running is not None and not running.done():
            return
        probe = state.breaker.state is BreakerState.HALF_OPEN and state.breaker.allows()
        due = self.next_canary.setdefault(state.worker_id, now + self.settings.canary_interval_s)
        if not probe and now < due:
            return
        if probe:
            state.breaker.take(now)
        self.next_canary[state.worker_id] = now + self.settings.canary_interval_s
        self.canaries[state.worker_id] = asyncio.create_task(self._canary(state))

    async def _canary(self, state: WorkerState) -> None:
        """One canary, given canary_timeout_s plus the time the worker says the work ahead of it
        takes: the prompt tokens it has yet to prefill (running prefills keep the step budget until
        they are done) and two of its longest steps (the one in flight, then the canary's own). A
        busy worker is not a broken one."""
        timeout_s = min(CANARY_TIMEOUT_LIMIT_S, self.settings.canary_timeout_s + _work_ahead_s(state.report))
        try:
            async with self.membership.session.get(
                f"{state.url}/health/canary",
                params={"timeout_s": str(timeout_s)},
                timeout=aiohttp.ClientTimeout(total=timeout_s + 1),
            ) as response:
                ok = response.status == 200
                reason = f"canary answered {response.status}"
        except (aiohttp.ClientError, TimeoutError) as exc:
            ok, reason = False, f"canary failed: {type(exc).__name__}"
        if ok:
            self.request_succeeded(state)
        else:
            state.breaker.record_failure(reason, time.monotonic())

    async def close(self) -> None:
        for task in self.canaries.values():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _expected_token_s(state: WorkerState) -> float | None:
    """The gap between tokens the worker's calibration predicts at its load now (the streams its
    report counts, or the router's own there if more)."""
    report = state.report
    if report is None:
        return None
    return expected_token_s(report.single_step_s, report.capability, max(report.running, len(state.in_flight)))


def _work_ahead_s(report: LoadReport | None) -> float:
    """Seconds of work a worker's load report says it has before a request admitted first."""
    if report is None:
        return 0.0
    rate = report.prefill_tokens_per_s
    prefill_s = (report.outstanding_prefill_tokens or 0) / rate if rate else 0.0
    return prefill_s + 2 * (report.longest_step_s or 0.0)
