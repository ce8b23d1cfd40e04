"""OpenTelemetry tracing for one process: a tracer provider of its own (no global state), spans
exported over OTLP/HTTP when an endpoint is configured, and the latest traces kept in memory for
the dashboard and `/debug/traces`. Trace context crosses processes in W3C `traceparent` headers.

Spans are started and ended explicitly and given their parent as a Context, never through the
"current span" of the calling task: a streamed response outlives the handler that started it.
"""

from __future__ import annotations

import json
import math
import os
import random
import threading
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import INVALID_SPAN_CONTEXT, NonRecordingSpan, Span, SpanContext, SpanKind, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from shoal.observability.trace_sampling import TraceBudget

# The OTLP endpoint when a process is not given one (the OpenTelemetry SDK's own variables).
OTLP_ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
DEFAULT_KEPT_TRACES = 500
UNSAMPLED = TraceFlags(TraceFlags.DEFAULT)
# FastAPI's own OpenTelemetry, off: shoal traces its requests itself. Left on, it looks up the global
# providers on every request (about 15 µs of the router's CPU each), and where one is configured it
# would trace every request a second time.
FASTAPI_TELEMETRY = {"tracing": False, "metrics": False, "logs": False}


def otlp_endpoint_from_environment() -> str | None:
    """The traces endpoint the environment names: the traces variable as is, or the general one
    with /v1/traces appended (as the SDK does)."""
    traces = os.environ.get(OTLP_ENDPOINT_VARIABLES[0])
    if traces:
        return traces
    general = os.environ.get(OTLP_ENDPOINT_VARIABLES[1])
    return general.rstrip("/") + "/v1/traces" if general else None


def span_record(span: ReadableSpan) -> dict:
    """A finished span as plain JSON: ids in hex, times in nanoseconds since the epoch."""
    context, parent = span.get_span_context(), span.parent
    return {
        "trace_id": f"{context.trace_id:032x}",
        "span_id": f"{context.span_id:016x}",
        "parent_span_id": f"{parent.span_id:016x}" if parent else None,
        "name": span.name,
        "service": span.resource.attributes.get("service.name"),
        "instance": span.resource.attributes.get("service.instance.id"),
        "kind": span.kind.name.lower(),
        "start_ns": span.start_time,
        "end_ns": span.end_time,
        "status": span.status.status_code.name.lower(),
        "attributes": dict(span.attributes or {}),
        "events": [
            {"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})} for e in span.events
        ],
        "links": [
            {"trace_id": f"{link.context.trace_id:032x}", "span_id": f"{link.context.span_id:016x}"}
            for link in span.links
        ],
    }


class RecentTraces(SpanProcessor):
    """The finished spans of the latest `keep` traces, turned into records only when read (the
    request path pays for keeping a reference). Invariant: at most `keep` traces are held; a new
    trace evicts the one least recently given a span. Safe to use from any thread."""

    def __init__(self, keep: int = DEFAULT_KEPT_TRACES):
        self.keep = keep
        self._traces: OrderedDict[int, list[ReadableSpan]] = OrderedDict()
        self._lock = threading.Lock()

    def on_end(self, span: ReadableSpan) -> None:
        trace_id = span.context.trace_id
        with self._lock:
            spans = self._traces.pop(trace_id, None) or []
            spans.append(span)
            self._traces[trace_id] = spans
            if len(self._traces) > self.keep:
                self._traces.popitem(last=False)

    def spans(self, trace_id: str) -> list[dict]:
        """The trace's spans held here, in start order (empty if unknown)."""
        try:
            key = int(trace_id, 16)
        except ValueError:
            return []
        with self._lock:
            spans = list(self._traces.get(key, []))
        return sorted(map(span_record, spans), key=lambda s: s["start_ns"])

    def roots(self, name: str, limit: int) -> list[dict]:
        """The latest finished spans called `name`, newest first."""
        with self._lock:
            found = [s for spans in self._traces.values() for s in spans if s.name == name]
        found.sort(key=lambda s: s.start_time, reverse=True)
        return [span_record(s) for s in found[:limit]]


class Tracing:
    """One process's tracing: `tracer` makes spans; they go to `recent` and, when `otlp_endpoint`
    is set (else the environment's), to that OTLP/HTTP collector in batches. `instance` tells
    processes of one service apart (a worker's URL). A trace is recorded when its caller's
    traceparent says it is sampled; a new trace when the TraceBudget of `traces_per_second` then
    `sample_ratio` admits it (by default every one). A trace not recorded costs next to nothing:
    its spans are ids only, decided here without the SDK, and go nowhere."""

    def __init__(
        self,
        service_name: str,
        otlp_endpoint: str | None = None,
        keep_traces: int = DEFAULT_KEPT_TRACES,
        instance: str | None = None,
        sample_ratio: float = 1.0,
        traces_per_second: float = math.inf,
    ):
        resource = {"service.name": service_name, **({"service.instance.id": instance} if instance else {})}
        # Every span reaching the SDK is to be recorded: start() decides sampling before it.
        self.provider = TracerProvider(resource=Resource.create(resource), sampler=ALWAYS_ON)
        self.budget = TraceBudget(traces_per_second, sample_ratio)
        self.recent = RecentTraces(keep_traces)
        self.provider.add_span_processor(self.recent)
        self.otlp_endpoint = otlp_endpoint or otlp_endpoint_from_environment()
        if self.otlp_endpoint:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            self.provider.add_span_processor(
                BatchSpanProcessor(OTLPSpanExporter(endpoint=self.otlp_endpoint), schedule_delay_millis=500)
            )
        self.tracer = self.provider.get_tracer("shoal")
        self.propagator = TraceContextTextMapPropagator()

    def start(
        self,
        name: str,
        parent: Context | Span | None = None,
        kind: SpanKind = SpanKind.INTERNAL,
        attributes: Mapping[str, object] | None = None,
        start_ns: int | None = None,
    ) -> Span:
        """A started span under `parent` (a span, a context from extract(), or None for a new trace).
        Under a span that is not recorded (its trace was not sampled) it is that span's context
        again, at no cost; a trace not sampled starts as ids only."""
        if type(parent) is NonRecordingSpan:  # not isinstance: spans are ABCs, slow to check
            return parent  # it ends as a no-op, like any span of a trace not recorded
        if isinstance(parent, Span):
            if not parent.is_recording():
                return NonRecordingSpan(parent.get_span_context())
            context = trace.set_span_in_context(parent)
        else:
            # A new trace (no parent: no context to look into) is the budget's to decide.
            caller = INVALID_SPAN_CONTEXT if parent is None else trace.get_current_span(parent).get_span_context()
            if not (caller.trace_flags.sampled if caller.is_valid else self.budget.admit()):
                return NonRecordingSpan(
                    SpanContext(
                        caller.trace_id if caller.is_valid else random.getrandbits(128),
                        random.getrandbits(64),
                        is_remote=False,
                        trace_flags=UNSAMPLED,
                        trace_state=caller.trace_state,
                    )
                )
            context = parent or Context()
        return self.tracer.start_span(name, context=context, kind=kind, attributes=attributes, start_time=start_ns)

    def extract(self, headers: Mapping[str, str]) -> Context | None:
        """The caller's trace context from its traceparent header (None if it sent none)."""
        traceparent = headers.get("traceparent")
        if traceparent is None:
            return None
        carrier = {"traceparent": traceparent}
        if "tracestate" in headers:
            carrier["tracestate"] = headers["tracestate"]
        return self.propagator.extract(carrier=carrier)

    def inject(self, span: Span, headers: MutableMapping[str, str]) -> None:
        """Adds `span` as the parent for the receiver: W3C's traceparent (its sampled flag tells the
        receiver whether to record) and tracestate."""
        context = span.get_span_context()
        if context.is_valid:
            headers["traceparent"] = f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"
            if context.trace_state:
                headers["tracestate"] = context.trace_state.to_header()

    def shutdown(self) -> None:
        """Exports what is pending."""
        self.provider.shutdown()


def json_attribute(value: object) -> str:
    """Span attributes are scalars or lists of them; structured values travel as JSON text."""
    return json.dumps(value, separators=(",", ":"), default=str)


def trace_id_of(span: Span) -> str:
    return f"{span.get_span_context().trace_id:032x}"
