"""One request as stream failover carries it from worker to worker (stream_failover.py)."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.router.fleet.membership import WorkerState
from shoal.router.placement.balancer import Placement
from shoal.router.request_telemetry import RequestTelemetry
from shoal.router.streams.continuation import by_tokens, can_continue, continuation_body, with_token_ids_asked
from shoal.router.streams.relay import StreamProgress
from shoal.router.streams.upstream_client import UpstreamResponse
from shoal.router.views import RouteRequest


@dataclass
class Attempt:
    """The request as it stands: where it runs, and the model and body it runs with (a critical
    request may have fallen back to another model before its first byte); its telemetry. While it
    `continues` a stream that has sent output, each worker gets the continuation of `body` its
    engine takes (with `kv_source` where it continues token-exact)."""

    routed: RouteRequest
    body: dict
    chat: bool  # a chat completion (else a text completion)
    telemetry: RequestTelemetry
    placement: Placement | None = None
    upstream: UpstreamResponse | None = None
    accepts_handoff: bool = True  # its worker may hand the stream off (shoal.protocol.kv_handoff)
    continues: StreamProgress | None = None
    kv_source: str | None = None

    def takes(self, worker: WorkerState) -> bool:
        """Whether this worker's engine can take the request as it stands (any, for a fresh start)."""
        return self.continues is None or can_continue(worker.engine, self.continues, self.body, self.chat)

    def continuation(self, worker: WorkerState) -> str | None:
        """How this worker continues the output already sent: "tokens", "text", or None (a fresh start)."""
        if self.continues is None:
            return None
        return "tokens" if by_tokens(worker.engine, self.continues) else "text"

    def body_for(self, worker: WorkerState) -> dict:
        """What this worker is sent."""
        progress = self.continues
        if progress is None:
            return with_token_ids_asked(self.body, worker.engine)
        body = continuation_body(self.body, progress, worker.engine, self.chat)
        if self.kv_source and by_tokens(worker.engine, progress):
            body["kv_source"] = self.kv_source
        return with_token_ids_asked(body, worker.engine)
