"""Graceful drain on SIGTERM: stop taking work (ready=false, 503 + Retry-After), let in-flight
requests finish within a grace period, then exit 0."""
from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field

import uvicorn


@dataclass
class DrainState:
    """Invariant: once `draining` is set it never clears; `in_flight` counts HTTP requests whose
    response has not been fully sent."""

    draining: bool = False
    in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def enter(self) -> None:
        with self.lock:
            self.in_flight += 1

    def leave(self) -> None:
        with self.lock:
            self.in_flight -= 1


class InFlightMiddleware:
    """ASGI middleware: counts requests until their last body message is sent, and answers new
    /v1/ requests with 503 + Retry-After once draining."""

    def __init__(self, app, state: DrainState, retry_after_s: int = 5):
        self.app = app
        self.state = state
        self.retry_after = str(retry_after_s).encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.state.draining and scope["path"].startswith("/v1/"):
            body = b'{"error": {"message": "this worker is draining", "type": "service_unavailable", "code": 503}}'
            await send({"type": "http.response.start", "status": 503, "headers": [
                (b"content-type", b"application/json"), (b"retry-after", self.retry_after)]})
            await send({"type": "http.response.body", "body": body})
            return
        self.state.enter()
        finished = False

        async def tracking_send(message):
            nonlocal finished
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not finished:
                finished = True
                self.state.leave()

        try:
            await self.app(scope, receive, tracking_send)
        finally:
            if not finished:
                self.state.leave()


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
        """Waits out the in-flight requests, then stops as a clean exit (status 0): the signal is
        not passed on to uvicorn, which would re-raise it after shutdown."""
        deadline = time.monotonic() + self.grace_period_s
        while self.state.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.should_exit = True
