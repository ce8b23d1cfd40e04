"""One client request as the router carries it, from the front door through stream failover."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from shoal.router.admission.auth import Client
from shoal.router.request_telemetry import RequestTelemetry
from shoal.router.streams.journal import JournalWriter
from shoal.router.views import RouteRequest


@dataclass(slots=True)
class RequestContext:
    """Invariants: `path`, `headers`, `chat`, `client` and `telemetry` (the request's one trace,
    finished once) are fixed for the request's life. `routed` and `body` are the request as the
    front door admits it: it may swap them (for a LoRA adapter's base model, latency targets, a
    fallback model, a shorter output) until it places the request, never after. `wait_s`,
    `extra_headers` and `journal` are set once it is placed, before stream failover serves it.
    What changes per attempt is each choice's Attempt's: its worker, the model and body it runs with
    (a critical request may fall back before its first byte), the workers it has tried, the output
    it continues."""

    routed: RouteRequest
    body: dict
    path: str
    headers: Mapping[str, str]
    chat: bool  # a chat completion (else a text completion, or embeddings)
    client: Client
    telemetry: RequestTelemetry
    wait_s: float = 0.0  # the most it waits for a worker: failover.wait_for_capacity_s, within x-shoal-deadline-s
    extra_headers: dict[str, str] = field(default_factory=dict)  # every answer's (x-shoal-router, ids, degraded)
    journal: JournalWriter | None = None  # follows its stream: a resumable single-choice stream, with a journal
