"""The latest requests as the dashboard lists them, one line each, from the router's in-memory
traces: the root `router.request` span says the model, status, time to first token, duration and
attempts; its `router.attempt` spans say which workers served it. One request's spans (the
waterfall) come from the router's and the workers' traces merged (trace_assembly.whole_trace).
"""

from __future__ import annotations

from shoal.observability.tracing import Tracing


def summarize(root: dict, spans: list[dict]) -> dict:
    """One finished request from its root span and the router's spans of its trace."""
    attributes = root["attributes"]
    workers = [s["attributes"].get("shoal.worker") for s in spans if s["name"] == "router.attempt"]
    event_names = [e["name"] for e in root["events"]]
    status = attributes.get("http.response.status_code")
    return {
        "trace_id": root["trace_id"],
        "time": root["start_ns"] / 1e9,
        "duration_s": (root["end_ns"] - root["start_ns"]) / 1e9 if root["end_ns"] else None,
        "model": attributes.get("shoal.model"),
        "priority": attributes.get("shoal.priority"),
        "route": attributes.get("http.route"),
        "stream": attributes.get("shoal.stream"),
        "status": status,
        "ok": root["status"] != "error" and (status is None or status < 400),
        "ttft_s": attributes.get("shoal.ttft_s"),
        "attempts": attributes.get("shoal.attempts", len(workers)),
        "output_tokens": attributes.get("shoal.output_tokens"),
        "workers": [w for w in workers if w],
        "retries": event_names.count("retry"),
        "migrations": event_names.count("migration"),
    }


def recent_requests(tracing: Tracing, limit: int) -> list[dict]:
    """The latest finished requests, newest first."""
    return [
        summarize(root, tracing.recent.spans(root["trace_id"]))
        for root in tracing.recent.roots("router.request", limit)
    ]
