"""One client request as the router's spans and metrics.

Spans, all under `router.request` (a child of the client's traceparent, if it sent one):
`router.admission` (waiting for a slot, when the request had to), `router.route` (each placement, with every candidate's
load, cached prefix and estimated seconds), and `router.attempt` for each worker tried (its
traceparent and the request id go to the worker, so the worker's spans hang under it and its logs
name the request). Retries and migrations are events on the root span, counted in the metrics and
put in the cluster's event feed; latencies are measured as the client sees them: from arrival at
the router to the first token relayed, between tokens, and to the end (histograms, and the
metrics' rolling window for the dashboard's live charts).
"""

from __future__ import annotations

import time
from collections.abc import MutableMapping

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from shoal.observability.cluster_events import ClusterEvents
from shoal.observability.logging import bind_request
from shoal.observability.tracing import Tracing, json_attribute, trace_id_of
from shoal.router.metrics import RouterMetrics
from shoal.router.placement.balancer import Placement
from shoal.router.placement.latency_targets import met
from shoal.router.placement.policies.cost import estimated_seconds
from shoal.router.views import RouteRequest


class RequestTelemetry:
    """Invariants: the root span ends exactly once, in `finish`, which also counts the request;
    every attempt span ends before the next one starts or at `finish`."""

    def __init__(
        self,
        tracing: Tracing,
        metrics: RouterMetrics,
        headers: MutableMapping[str, str] | dict,
        path: str,
        events: ClusterEvents | None = None,
    ):
        self.tracing, self.metrics, self.events = tracing, metrics, events
        self.started = time.monotonic()
        self.root = tracing.start(
            "router.request", parent=tracing.extract(headers), kind=SpanKind.SERVER, attributes={"http.route": path}
        )
        self.trace_id = trace_id_of(self.root)
        self.request_id = headers.get("x-request-id") or self.trace_id
        bind_request(self.request_id, self.trace_id)
        self.model, self.priority = "unknown", "standard"
        self.streaming = False
        self.attempt_span: Span | None = None
        self.attempts = 0
        self.worker_id: str | None = None  # of the current attempt
        self.output_tokens = 0  # relayed to the client
        self.last_token: float | None = None
        self.first_token: float | None = None
        self.routed: RouteRequest | None = None
        self.finished = False

    def routed_as(self, request: RouteRequest, streaming: bool) -> None:
        self.model, self.priority, self.streaming = request.model, request.priority, streaming
        self.routed = request
        self.root.set_attributes(
            {
                "shoal.model": request.model,
                "shoal.priority": request.priority,
                "shoal.prompt_tokens_estimate": request.prompt_tokens,
                "shoal.stream": streaming,
            }
        )

    def span(self, name: str, **attributes: object) -> Span:
        """A child of the root span, started now; the caller ends it."""
        return self.tracing.start(name, parent=self.root, attributes=attributes)

    def placed(self, request: RouteRequest, placement: Placement | None, policy: str, started_ns: int) -> None:
        """Records a routing decision as a `router.route` span (from started_ns to now)."""
        span = self.tracing.start(
            "router.route",
            parent=self.root,
            start_ns=started_ns,
            attributes={"shoal.policy": policy, "shoal.model": request.model},
        )
        if placement is not None and span.is_recording():
            context = placement.context
            span.set_attributes(
                {
                    "shoal.worker": placement.worker.worker_id,
                    "shoal.cached_tokens_estimate": placement.cached_tokens,
                    "shoal.candidates": json_attribute(
                        [
                            {
                                "worker": view.worker_id,
                                "load": view.load,
                                "outstanding_tokens": view.outstanding_tokens,
                                "matched_blocks": context.matched_blocks.get(view.worker_id, 0),
                                "estimated_s": round(
                                    estimated_seconds(request, view, placement.candidates, context), 4
                                ),
                            }
                            for view in placement.candidates
                        ]
                    ),
                }
            )
        elif placement is None:
            span.set_status(Status(StatusCode.ERROR, "no worker can take the request"))
        span.end()

    def attempt(self, worker_id: str, url: str, continuation: str | None, headers: MutableMapping[str, str]) -> None:
        """Starts the span of one try on a worker and puts its traceparent in the outgoing headers;
        `continuation` says how it continues output already sent ("tokens" or "text"), if it does."""
        self.end_attempt("abandoned")
        self.attempts += 1
        self.worker_id = worker_id
        attributes = None
        if self.root.is_recording():  # a trace not recorded takes none: skip building them
            attributes = {
                "shoal.worker": worker_id,
                "server.address": url,
                "shoal.attempt": self.attempts,
                "shoal.resume": continuation is not None,
                **({"shoal.continuation": continuation} if continuation else {}),
            }
        self.attempt_span = self.tracing.start(
            "router.attempt", parent=self.root, kind=SpanKind.CLIENT, attributes=attributes
        )
        self.tracing.inject(self.attempt_span, headers)
        headers["x-request-id"] = self.request_id

    def end_attempt(self, outcome: str, error: str | None = None) -> None:
        if self.attempt_span is None:
            return
        self.attempt_span.set_attribute("shoal.outcome", outcome)
        if error:
            self.attempt_span.set_status(Status(StatusCode.ERROR, error))
        self.attempt_span.end()
        self.attempt_span = None

    def retried(self, worker_id: str, reason: str) -> None:
        self.metrics.child(self.metrics.retries, self.model).inc()
        self.root.add_event("retry", {"shoal.worker": worker_id, "shoal.reason": reason})
        if self.events is not None:
            self.events.record(
                "failover",
                "retried",
                reason,
                worker_id=worker_id,
                model=self.model,
                attempt=self.attempts,
                trace_id=self.trace_id,
            )

    def migrated(self, worker_id: str, tokens: int, reason: str) -> None:
        self.metrics.child(self.metrics.migrations, self.model).inc()
        self.root.add_event(
            "migration", {"shoal.worker": worker_id, "shoal.tokens_so_far": tokens, "shoal.reason": reason}
        )
        if self.events is not None:
            self.events.record(
                "failover",
                "migrated",
                reason,
                worker_id=worker_id,
                model=self.model,
                tokens=tokens,
                trace_id=self.trace_id,
            )

    def handed_off(self, worker_id: str, tokens: int, reason: str) -> None:
        self.metrics.child(self.metrics.handoffs, self.model, reason).inc()
        self.root.add_event(
            "handoff", {"shoal.worker": worker_id, "shoal.tokens_so_far": tokens, "shoal.reason": reason}
        )

    def tokens(self, count: int) -> None:
        """`count` tokens relayed to the client now."""
        now = time.monotonic()
        gap_s = None if self.last_token is None else (now - self.last_token) / count
        if gap_s is None:
            self.first_token = now
            self.metrics.child(self.metrics.ttft, self.model).observe(now - self.started)
            self.metrics.window.first_token(now - self.started, now)
            self.root.set_attribute("shoal.ttft_s", round(now - self.started, 6))
        else:
            self.metrics.child(self.metrics.itl, self.model).observe(gap_s)
        self.metrics.window.relayed(self.worker_id, count, gap_s, now)
        self.output_tokens += count
        self.last_token = now

    def _met(self, routed: RouteRequest) -> bool:
        """Whether the tokens relayed met the request's targets (a request answered whole, without
        tokens counted on the way, by its end)."""
        end = self.last_token or time.monotonic()
        ttft = (self.first_token or end) - self.started
        tpot = (
            (end - self.first_token) / (self.output_tokens - 1) if self.first_token and self.output_tokens > 1 else None
        )
        return met(routed, ttft, tpot)

    def failed(self, message: str) -> None:
        self.root.set_status(Status(StatusCode.ERROR, message))

    def finish(self, status: int) -> None:
        if self.finished:
            return
        self.finished = True
        self.end_attempt("done" if status < 400 else "failed")
        self.metrics.child(self.metrics.requests, self.model, str(status), self.priority).inc()
        elapsed = time.monotonic() - self.started
        self.metrics.window.request_finished(status, elapsed)
        routed = self.routed
        if routed is not None and (routed.ttft_target_s is not None or routed.tpot_target_s is not None):
            outcome = "met" if status < 400 and self._met(routed) else "missed"
            self.metrics.child(self.metrics.targets, self.model, outcome).inc()
        if status < 400:
            self.metrics.child(self.metrics.e2e, self.model).observe(elapsed)
        else:
            self.root.set_status(Status(StatusCode.ERROR, f"HTTP {status}"))
        self.root.set_attributes(
            {
                "http.response.status_code": status,
                "shoal.attempts": self.attempts,
                "shoal.output_tokens": self.output_tokens,
            }
        )
        self.root.end()
