"""One choice of a request as stream failover carries it from worker to worker (failover.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.router.fleet.worker_state import WorkerState
from shoal.router.placement.balancer import Placement
from shoal.router.streams.continuation import by_tokens, can_continue, continuation_body, with_token_ids_asked
from shoal.router.streams.relay import StreamProgress
from shoal.router.streams.request_context import RequestContext
from shoal.router.streams.tried_workers import TriedWorkers
from shoal.router.streams.upstream_client import UpstreamResponse
from shoal.router.views import RouteRequest


@dataclass
class Attempt:
    """The choice as it stands: where it runs, the workers it has tried, and the model and body it
    runs with (`routed` starts as the request's; a critical request may have fallen back to another
    model before its first byte). While it `continues` a stream that has sent output, each worker
    gets the continuation of `body` its engine takes (with `kv_source` where it continues token-exact)."""

    request: RequestContext
    body: dict
    placement: Placement | None = None
    routed: RouteRequest = field(init=False)
    tried: TriedWorkers = field(default_factory=TriedWorkers)
    upstream: UpstreamResponse | None = None
    accepts_handoff: bool = True  # its worker may hand the stream off (shoal.protocol.kv_handoff)
    continues: StreamProgress | None = None
    kv_source: str | None = None

    def __post_init__(self) -> None:
        self.routed = self.request.routed

    def takes(self, worker: WorkerState) -> bool:
        """Whether this worker's engine can take the request as it stands (any, for a fresh start)."""
        return self.continues is None or can_continue(worker.engine, self.continues, self.body, self.request.chat)

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
        body = continuation_body(self.body, progress, worker.engine, self.request.chat)
        if self.kv_source and by_tokens(worker.engine, progress):
            body["kv_source"] = self.kv_source
        return with_token_ids_asked(body, worker.engine)
