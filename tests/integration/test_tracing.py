"""Tracing end to end: one request through a router, a failing worker (a retry) and a real worker,
exported over OTLP to a collector, forms one trace: the client's traceparent is its root's parent,
the router's routing (with every candidate's scores) and both attempts hang under the request, and
the worker's request, queue, prefill and decode spans under the attempt that reached it. The
router's in-memory traces give the same spans, the worker's fetched from the worker."""

from __future__ import annotations

import json
import secrets

import httpx

from tests.support.fleet import ADMIN
from tests.support.traces import MAX_TOKENS, streamed
from tests.support.waiting import wait_for
from tests.support.workers import MODEL, spawn_worker, tiny_worker_args, wait_ready


def test_one_request_through_router_retry_and_worker_is_one_trace(traced_fleet):
    url, failing, real, collector, router_log = traced_fleet
    client_trace, client_span = secrets.token_hex(16), secrets.token_hex(8)
    answers = [streamed(url, f"00-{client_trace}-{client_span}-01") for _ in range(2)]
    assert {trace for trace, _ in answers} == {client_trace}  # the client's trace continues through the router

    def retried_request() -> list[dict]:
        spans = collector.trace(client_trace)
        roots = [s for s in spans if s["name"] == "router.request" and s["attributes"].get("shoal.attempts") == 2]
        if not roots:
            return []
        mine = {roots[0]["span_id"]}
        while True:  # the root and all its descendants
            grown = mine | {s["span_id"] for s in spans if s["parent_span_id"] in mine}
            if grown == mine:
                return [s for s in spans if s["span_id"] in mine]
            mine = grown

    spans = wait_for(
        lambda: (found := retried_request()) and any(s["name"] == "engine.decode" for s in found) and found,
        timeout_s=30,
    )
    named = {}
    for span in spans:
        named.setdefault(span["name"], []).append(span)
    [root] = named["router.request"]
    assert root["parent_span_id"] == client_span and root["service"] == "shoal-router"
    assert root["attributes"]["shoal.model"] == MODEL and root["attributes"]["shoal.priority"] == "standard"
    assert root["attributes"]["http.response.status_code"] == 200 and root["attributes"]["shoal.stream"] is True
    assert [e["attributes"]["shoal.worker"] for e in root["events"] if e["name"] == "retry"] == [failing]

    assert "router.admission" not in named  # admitted at once: no wait to show
    first_route, retry_route = sorted(named["router.route"], key=lambda s: s["start_ns"])
    candidates = json.loads(first_route["attributes"]["shoal.candidates"])
    assert {c["worker"] for c in candidates} == {failing, real}
    assert all(c["estimated_s"] > 0 and "load" in c and "matched_blocks" in c for c in candidates)
    assert first_route["attributes"]["shoal.worker"] == failing and retry_route["attributes"]["shoal.worker"] == real

    failed, served = sorted(named["router.attempt"], key=lambda s: s["start_ns"])
    assert (failed["attributes"]["shoal.worker"], failed["attributes"]["shoal.outcome"]) == (failing, "failed")
    assert (served["attributes"]["shoal.worker"], served["attributes"]["shoal.outcome"]) == (real, "done")
    assert failed["attributes"]["shoal.attempt"] == 1 and served["attributes"]["shoal.attempt"] == 2

    [worker] = named["worker.request"]
    assert worker["service"] == "shoal-worker" and worker["parent_span_id"] == served["span_id"]
    for name in ("engine.queue", "engine.prefill", "engine.decode"):
        assert [s["parent_span_id"] for s in named[name]] == [worker["span_id"]], name
    assert named["engine.prefill"][0]["attributes"]["shoal.prompt_tokens"] > 0
    assert named["engine.decode"][0]["attributes"]["shoal.output_tokens"] == MAX_TOKENS
    assert worker["start_ns"] <= named["engine.prefill"][0]["start_ns"] <= named["engine.decode"][0]["start_ns"]

    held = httpx.get(f"{url}/debug/traces/{client_trace}", headers=ADMIN, timeout=10).json()["spans"]
    assert {s["span_id"] for s in spans} <= {s["span_id"] for s in held}  # the worker's spans fetched from it
    recent = httpx.get(f"{url}/debug/traces", headers=ADMIN, timeout=10).json()["requests"]
    assert root["span_id"] in {r["span_id"] for r in recent}

    router_log.seek(0)
    retry_lines = [
        json.loads(line)
        for line in router_log.read().decode().splitlines()
        if line.startswith("{") and "trying another worker" in line
    ]
    assert retry_lines and all(line["trace_id"] == client_trace and line["level"] == "INFO" for line in retry_lines)
    assert {line["request_id"] for line in retry_lines} <= {request_id for _, request_id in answers}

    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert f'shoal_router_requests_total{{model="{MODEL}",priority="standard",status="200"}} 2.0' in metrics
    assert f'shoal_router_retries_total{{model="{MODEL}"}}' in metrics
    assert f'shoal_router_time_to_first_token_seconds_count{{model="{MODEL}"}} 2.0' in metrics


def test_a_pipeline_workers_prefill_shows_its_stage_hops(tiny_model_dir, shoal_cache_dir):
    """A two-stage pipeline worker: the step that produced the first token appears as one span per
    stage under the prefill, the head's before the last stage's."""
    process, url = wait_ready(
        *spawn_worker(
            tiny_worker_args(tiny_model_dir, MODEL, "--pipeline-parallel-size", "2"),
            shoal_cache_dir,
        )
    )
    try:
        trace = secrets.token_hex(16)
        response = httpx.post(
            url + "/v1/completions",
            timeout=60,
            headers={"traceparent": f"00-{trace}-{'1' * 16}-01"},
            json={"model": MODEL, "prompt": "hello there", "max_tokens": 3},
        )
        assert response.status_code == 200
        spans = httpx.get(f"{url}/debug/traces/{trace}", timeout=10).json()["spans"]
        [prefill] = [s for s in spans if s["name"] == "engine.prefill"]
        hops = [s for s in spans if s["name"] == "pipeline.stage"]
        assert [h["attributes"]["shoal.stage"] for h in hops] == [0, 1]
        assert all(h["parent_span_id"] == prefill["span_id"] for h in hops)
        assert hops[0]["end_ns"] <= hops[1]["start_ns"]
    finally:
        process.kill()
        process.wait(timeout=30)
