"""A worker's spans for one request: `worker.request` (a child of the router attempt's
traceparent), and under it the engine's part, reconstructed from the engine's timestamps:
`engine.queue` (arrival to first scheduling), `engine.prefill` (to the first token; with a
`pipeline.stage` span per stage of the step that produced it) and `engine.decode` (to the end)."""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from shoal.engine.sequence import Sequence
from shoal.observability.logging import bind_request
from shoal.observability.tracing import Tracing, trace_id_of


def epoch_ns(monotonic_s: float) -> int:
    """A time.monotonic() reading as nanoseconds since the epoch."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


class EngineSpans:
    """The engine's RequestObserver for traces. Invariant: a request's engine spans are made only
    while its worker span is registered (from before it is submitted until its response ends)."""

    def __init__(self, tracing: Tracing):
        self.tracing = tracing
        self._parents: dict[str, Span] = {}
        self._lock = threading.Lock()

    def register(self, request_id: str, span: Span) -> None:
        with self._lock:
            self._parents[request_id] = span

    def forget(self, request_id: str) -> None:
        with self._lock:
            self._parents.pop(request_id, None)

    def _parent(self, seq: Sequence) -> Span | None:
        with self._lock:
            return self._parents.get(seq.request_id)

    def first_token(self, seq: Sequence, time_to_first_token_s: float) -> None:
        parent = self._parent(seq)
        if parent is None:
            return
        scheduled = epoch_ns(seq.first_scheduled_time or seq.arrival_time)
        queue = self.tracing.start("engine.queue", parent=parent, start_ns=epoch_ns(seq.arrival_time))
        queue.end(scheduled)
        prefill = self.tracing.start(
            "engine.prefill",
            parent=parent,
            start_ns=scheduled,
            attributes={
                "shoal.prompt_tokens": len(seq.prompt_token_ids),
                "shoal.cached_tokens": seq.num_cached_tokens,
                "shoal.resumed_tokens": len(seq.output_token_ids) - 1,
                "shoal.preemptions": seq.num_preemptions,
            },
        )
        for stage, started, ended in seq.first_token_stage_times:
            self.tracing.start(
                "pipeline.stage", parent=prefill, start_ns=started, attributes={"shoal.stage": stage}
            ).end(ended)
        prefill.end(epoch_ns(seq.first_token_time))

    def next_token(self, seq: Sequence, inter_token_latency_s: float) -> None:
        pass

    def finished(self, seq: Sequence, e2e_latency_s: float) -> None:
        parent = self._parent(seq)
        if parent is None or seq.first_token_time is None:
            return
        decode = self.tracing.start(
            "engine.decode",
            parent=parent,
            start_ns=epoch_ns(seq.first_token_time),
            attributes={
                "shoal.output_tokens": len(seq.output_token_ids),
                "shoal.finish_reason": seq.finish_reason or "unknown",
            },
        )
        decode.end()


class WorkerRequestSpan:
    """One HTTP request's `worker.request` span and the engine requests under it. Invariant:
    `end` ends the span once and unregisters every engine request it tracked."""

    def __init__(self, tracing: Tracing, engine_spans: EngineSpans, headers: Mapping[str, str], route: str, model: str):
        self.engine_spans = engine_spans
        self.span = tracing.start(
            "worker.request",
            parent=tracing.extract(headers),
            kind=SpanKind.SERVER,
            attributes={"http.route": route, "shoal.model": model},
        )
        bind_request(headers.get("x-request-id"), trace_id_of(self.span))
        self.request_ids: list[str] = []
        self.ended = False

    def track(self, request_id: str) -> None:
        self.request_ids.append(request_id)
        self.engine_spans.register(request_id, self.span)

    def end(self, error: str | None = None) -> None:
        if self.ended:
            return
        self.ended = True
        for request_id in self.request_ids:
            self.engine_spans.forget(request_id)
        if error:
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()
