"""Graceful drain on SIGTERM: stop taking work (ready=false; admission answers 503 + Retry-After),
let in-flight requests finish within a grace period (streams a router can continue elsewhere are
handed off at their next token instead: shoal.worker.kv_mobility), stay up while other workers
still fetch their KV, then stop the server (which cuts what is still open after its own short
graceful-shutdown timeout) and exit 0."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field

import uvicorn


@dataclass
class DrainState:
    """Invariant: once `draining` is set it never clears; `in_flight` counts HTTP requests whose
    response has not been fully sent; the drain does not end before `held_until` (monotonic), which
    only grows."""

    draining: bool = False
    in_flight: int = 0
    held_until: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def hold(self, seconds: float) -> None:
        """Keeps the worker up at least `seconds` more (within the grace period)."""
        with self.lock:
            self.held_until = max(self.held_until, time.monotonic() + seconds)

    def enter(self) -> None:
        with self.lock:
            self.in_flight += 1

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn server whose first SIGTERM drains instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, state: DrainState, grace_period_s: float):
        super().__init__(config)
        self.state = state
        self.grace_period_s = grace_period_s

    def handle_exit(self, sig: int, frame) -> None:
        if sig == signal.SIGTERM and not self.state.draining:
            self.state.draining = True
            threading.Thread(target=self._finish_drain, daemon=True).start()
            return
        super().handle_exit(sig, frame)

    def _finish_drain(self) -> None:
        """Waits out the in-flight requests and the holds, then stops as a clean exit (status 0):
        the signal is not passed on to uvicorn, which would re-raise it after shutdown."""
        deadline = time.monotonic() + self.grace_period_s
        while (self.state.in_flight > 0 or time.monotonic() < self.state.held_until) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True
