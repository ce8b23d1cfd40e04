"""One client request as the router's spans and metrics.

Spans, all under `router.request` (a child of the client's traceparent, if it sent one):
`router.admission` (waiting for a slot), `router.route` (each placement, with every candidate's
load, cached prefix and estimated seconds), and `router.attempt` for each worker tried (its
traceparent goes to the worker, so the worker's spans hang under it). Retries and migrations are
events on the root span and counted in the metrics; latencies are measured as the client sees
them: from arrival at the router to the first token relayed, between tokens, and to the end.
"""
from __future__ import annotations

import time
from collections.abc import MutableMapping

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from shoal.observability.router_metrics import RouterMetrics
from shoal.observability.tracing import Tracing, json_attribute, trace_id_of
from shoal.router.balancer import Placement
from shoal.router.policies.cost import estimated_seconds
from shoal.router.views import RouteRequest


class RequestTelemetry:
    """Invariants: the root span ends exactly once, in `finish`, which also counts the request;
    every attempt span ends before the next one starts or at `finish`."""

    def __init__(self, tracing: Tracing, metrics: RouterMetrics, headers: MutableMapping[str, str] | dict, path: str):
        self.tracing, self.metrics = tracing, metrics
        self.started = time.monotonic()
        self.root = tracing.start("router.request", parent=tracing.extract(headers), kind=SpanKind.SERVER,
                                  attributes={"http.route": path})
        self.trace_id = trace_id_of(self.root)
        self.model, self.priority = "unknown", "standard"
        self.streaming = False
        self.attempt_span: Span | None = None
        self.attempts = 0
        self.last_token: float | None = None
        self.finished = False

    def routed_as(self, request: RouteRequest, streaming: bool) -> None:
        self.model, self.priority, self.streaming = request.model, request.priority, streaming
        self.root.set_attributes({"shoal.model": request.model, "shoal.priority": request.priority,
                                  "shoal.prompt_tokens_estimate": request.prompt_tokens, "shoal.stream": streaming})

    def span(self, name: str, **attributes: object) -> Span:
        """A child of the root span, started now; the caller ends it."""
        return self.tracing.start(name, parent=self.root, attributes=attributes)

    def placed(self, request: RouteRequest, placement: Placement | None, policy: str, started_ns: int) -> None:
        """Records a routing decision as a `router.route` span (from started_ns to now)."""
        span = self.tracing.start("router.route", parent=self.root, start_ns=started_ns,
                                  attributes={"shoal.policy": policy, "shoal.model": request.model})
        if placement is not None:
            context = placement.context
            span.set_attributes({
                "shoal.worker": placement.worker.worker_id, "shoal.cached_tokens_estimate": placement.cached_tokens,
                "shoal.candidates": json_attribute([
                    {"worker": view.worker_id, "load": view.load, "outstanding_tokens": view.outstanding_tokens,
                     "matched_blocks": context.matched_blocks.get(view.worker_id, 0),
                     "estimated_s": round(estimated_seconds(request, view, placement.candidates, context), 4)}
                    for view in placement.candidates])})
        else:
            span.set_status(Status(StatusCode.ERROR, "no worker can take the request"))
        span.end()

    def attempt(self, worker_id: str, url: str, resuming: bool, headers: MutableMapping[str, str]) -> None:
        """Starts the span of one try on a worker and puts its traceparent in the outgoing headers."""
        self.end_attempt("abandoned")
        self.attempts += 1
        self.attempt_span = self.tracing.start("router.attempt", parent=self.root, kind=SpanKind.CLIENT, attributes={
            "shoal.worker": worker_id, "server.address": url, "shoal.attempt": self.attempts, "shoal.resume": resuming})
        self.tracing.inject(self.attempt_span, headers)

    def end_attempt(self, outcome: str, error: str | None = None) -> None:
        if self.attempt_span is None:
            return
        self.attempt_span.set_attribute("shoal.outcome", outcome)
        if error:
            self.attempt_span.set_status(Status(StatusCode.ERROR, error))
        self.attempt_span.end()
        self.attempt_span = None

    def retried(self, worker_id: str, reason: str) -> None:
        self.metrics.retries.labels(self.model).inc()
        self.root.add_event("retry", {"shoal.worker": worker_id, "shoal.reason": reason})

    def migrated(self, worker_id: str, tokens: int, reason: str) -> None:
        self.metrics.migrations.labels(self.model).inc()
        self.root.add_event("migration", {"shoal.worker": worker_id, "shoal.tokens_so_far": tokens,
                                          "shoal.reason": reason})

    def tokens(self, count: int) -> None:
        """`count` tokens relayed to the client now."""
        now = time.monotonic()
        if self.last_token is None:
            self.metrics.ttft.labels(self.model).observe(now - self.started)
            self.root.set_attribute("shoal.ttft_s", round(now - self.started, 6))
        else:
            self.metrics.itl.labels(self.model).observe((now - self.last_token) / count)
        self.last_token = now

    def failed(self, message: str) -> None:
        self.root.set_status(Status(StatusCode.ERROR, message))

    def finish(self, status: int) -> None:
        if self.finished:
            return
        self.finished = True
        self.end_attempt("done" if status < 400 else "failed")
        self.metrics.requests.labels(self.model, str(status), self.priority).inc()
        if status < 400:
            self.metrics.e2e.labels(self.model).observe(time.monotonic() - self.started)
        else:
            self.root.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        self.root.set_attributes({"http.response.status_code": status, "shoal.attempts": self.attempts})
        self.root.end()
