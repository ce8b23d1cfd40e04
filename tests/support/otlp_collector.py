"""An OTLP/HTTP trace receiver on loopback, for tests: what the OpenTelemetry collector would get.
It decodes each export (protobuf, as the SDK's exporter sends it) into plain span records."""

from __future__ import annotations

import gzip
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)

from shoal.processes import free_port


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class OtlpCollector:
    """Collects spans POSTed to `endpoint` (…/v1/traces). Thread-safe; `spans` grows only."""

    def __init__(self):
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        collector = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers["content-length"]))
                if self.headers.get("content-encoding") == "gzip":
                    raw = gzip.decompress(raw)
                request = ExportTraceServiceRequest()
                request.ParseFromString(raw)
                collector._add(request)
                body = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *_) -> None:
                pass

        port = free_port()
        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.endpoint = f"http://127.0.0.1:{port}/v1/traces"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def _add(self, request: ExportTraceServiceRequest) -> None:
        records = []
        for resource_spans in request.resource_spans:
            resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    records.append(
                        {
                            "service": resource.get("service.name"),
                            "trace_id": span.trace_id.hex(),
                            "span_id": span.span_id.hex(),
                            "parent_span_id": span.parent_span_id.hex() or None,
                            "name": span.name,
                            "start_ns": span.start_time_unix_nano,
                            "end_ns": span.end_time_unix_nano,
                            "attributes": {a.key: _value(a.value) for a in span.attributes},
                            "events": [
                                {"name": e.name, "attributes": {a.key: _value(a.value) for a in e.attributes}}
                                for e in span.events
                            ],
                            "status": span.status.code,
                        }
                    )
        with self._lock:
            self.spans += records

    def trace(self, trace_id: str) -> list[dict]:
        with self._lock:
            return [s for s in self.spans if s["trace_id"] == trace_id]

    def close(self) -> None:
        self.server.shutdown()
