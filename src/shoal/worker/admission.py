"""Admission at the HTTP edge: body-size limit (413), draining and overload (503 + Retry-After),
and the count of in-flight requests that a drain waits for."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shoal.errors import error_json
from shoal.protocol.request_body import body_within
from shoal.worker.drain import DrainState


@dataclass(frozen=True)
class AdmissionLimits:
    """max_body_bytes bounds a request body; max_waiting_requests bounds the engine's queue (new
    work beyond it gets 503); retry_after_s is what refused clients are told to wait."""

    max_body_bytes: int = 4 << 20
    max_waiting_requests: int = 1024
    retry_after_s: int = 5


class AdmissionMiddleware:
    """ASGI middleware over /v1/ requests. Invariant: a request is counted in-flight from admission
    until its last body message is sent; refused requests are never counted."""

    def __init__(self, app, state: DrainState, limits: AdmissionLimits, waiting_requests: Callable[[], int]):
        self.app = app
        self.state = state
        self.limits = limits
        self.waiting_requests = waiting_requests

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        if self.state.draining:
            return await self._refuse(send, 503, "this worker is draining", "service_unavailable")
        if self.waiting_requests() >= self.limits.max_waiting_requests:
            return await self._refuse(send, 503, "this worker is overloaded", "service_unavailable")
        body = await self._read_body(scope, receive)
        if body is None:
            return await self._refuse(
                send, 413, f"request body exceeds {self.limits.max_body_bytes} bytes", "invalid_request_error"
            )
        self.state.enter()
        finished = False
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body, only a disconnect can come

        async def tracking_send(message):
            nonlocal finished
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body", False) and not finished:
                finished = True
                self.state.leave()

        try:
            await self.app(scope, replay, tracking_send)
        finally:
            if not finished:
                self.state.leave()

    async def _read_body(self, scope, receive) -> bytes | None:
        """The whole body, or None once it is known to exceed the limit (by header or by count)."""
        limit = self.limits.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and value.isdigit() and int(value) > limit:
                return None
        return await body_within(receive, limit)

    async def _refuse(self, send, status: int, message: str, kind: str) -> None:
        body = error_json(message, status, kind)
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        if status == 503:
            headers.append((b"retry-after", str(self.limits.retry_after_s).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
