"""In-memory traces: bounded by trace count, read back as records; sampling follows the caller's
traceparent, else the ratio."""

from __future__ import annotations

from shoal.observability.tracing import Tracing, trace_id_of


def test_the_latest_traces_are_kept_and_read_back_in_start_order():
    tracing = Tracing("test", keep_traces=2)
    trace_ids = []
    for _ in range(3):
        root = tracing.start("router.request")
        tracing.start("router.route", parent=root).end()
        root.end()
        trace_ids.append(trace_id_of(root))
    assert tracing.recent.spans(trace_ids[0]) == []  # evicted
    spans = tracing.recent.spans(trace_ids[2])
    assert [s["name"] for s in spans] == ["router.request", "router.route"]
    assert spans[1]["parent_span_id"] == spans[0]["span_id"] and spans[0]["parent_span_id"] is None
    assert [r["trace_id"] for r in tracing.recent.roots("router.request", 5)] == trace_ids[:0:-1]
    assert tracing.recent.spans("not-hex") == []


def test_unsampled_requests_leave_nothing_unless_their_caller_sampled_them():
    tracing = Tracing("test", sample_ratio=0.0, traces_per_second=0)
    dropped = tracing.start("router.request")
    child = tracing.start("router.route", parent=dropped)
    child.end()
    dropped.end()
    assert tracing.recent.spans(trace_id_of(dropped)) == []
    assert trace_id_of(child) == trace_id_of(dropped) != "0" * 32
    unsampled: dict[str, str] = {}
    tracing.inject(child, unsampled)  # the worker is told not to record it either
    assert unsampled["traceparent"] == f"00-{trace_id_of(dropped)}-{child.get_span_context().span_id:016x}-00"
    caller = "0af7651916cd43dd8448eb211c80319c"
    kept = tracing.start("router.request", parent=tracing.extract({"traceparent": f"00-{caller}-b7ad6b7169203331-01"}))
    kept.end()
    assert trace_id_of(kept) == caller and len(tracing.recent.spans(caller)) == 1
    headers: dict[str, str] = {}
    tracing.inject(kept, headers)
    assert headers["traceparent"].startswith(f"00-{caller}-") and headers["traceparent"].endswith("-01")
