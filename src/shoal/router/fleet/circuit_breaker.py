"""A circuit breaker per worker: closed (work flows), open (no work), half-open (one probe at a time).

Failures are what passive detection sees (connection errors, timeouts, 5xx, failed streams, failed
canaries); any other answer, 4xx included, is a success. `failure_threshold` consecutive failures
open the breaker; after `open_s` it turns half-open and lets one probe through (a real request or
the canary): success closes it, failure opens it again for twice as long (at most `max_open_s`).
"""

from __future__ import annotations

from collections.abc import Callable
from enum import StrEnum


class BreakerState(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    """Invariants: `probe_in_flight` only while half-open; `open_for` is in [open_s, max_open_s];
    every state change is reported once to `on_change(old, new, reason)`."""

    def __init__(
        self,
        failure_threshold: int,
        open_s: float,
        max_open_s: float,
        on_change: Callable[[BreakerState, BreakerState, str], None],
    ):
        self.failure_threshold = failure_threshold
        self.open_s = open_s
        self.max_open_s = max_open_s
        self.on_change = on_change
        self.state = BreakerState.CLOSED
        self.consecutive_failures = 0
        self.open_for = open_s
        self.reopens_at = 0.0
        self.probe_in_flight = False
        self.probe_sent_at = 0.0

    def allows(self) -> bool:
        """Whether a request may be sent now (half-open: only when no probe is out)."""
        return self.state is BreakerState.CLOSED or (self.state is BreakerState.HALF_OPEN and not self.probe_in_flight)

    def take(self, now: float) -> None:
        """A request was sent; while half-open it is the probe."""
        if self.state is BreakerState.HALF_OPEN:
            self.probe_in_flight, self.probe_sent_at = True, now

    def tick(self, now: float) -> None:
        """Time-driven changes: open turns half-open after open_for; a probe that never reported
        (its client went away) frees the probe slot after open_s."""
        if self.state is BreakerState.OPEN and now >= self.reopens_at:
            self._move(BreakerState.HALF_OPEN, f"open for {self.open_for:g} s")
        elif self.probe_in_flight and now - self.probe_sent_at > self.open_s:
            self.probe_in_flight = False

    def record_success(self) -> None:
        self.consecutive_failures = 0
        if self.state is BreakerState.HALF_OPEN:
            self.open_for = self.open_s
            self._move(BreakerState.CLOSED, "probe succeeded")

    def record_failure(self, reason: str, now: float) -> None:
        self.consecutive_failures += 1
        if self.state is BreakerState.HALF_OPEN:
            self.open_for = min(self.open_for * 2, self.max_open_s)
            self._open(f"probe failed: {reason}", now)
        elif self.state is BreakerState.CLOSED and self.consecutive_failures >= self.failure_threshold:
            self._open(f"{self.consecutive_failures} consecutive failures, last: {reason}", now)

    def _open(self, reason: str, now: float) -> None:
        self.reopens_at = now + self.open_for
        self._move(BreakerState.OPEN, reason)

    def _move(self, state: BreakerState, reason: str) -> None:
        old, self.state, self.probe_in_flight = self.state, state, False
        self.on_change(old, state, reason)
