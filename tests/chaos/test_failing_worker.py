"""A worker that answers errors: 5xx open its circuit breaker (requests succeed elsewhere, the client
never sees the 500), 4xx never do; once it answers properly again a half-open probe closes it.

The failing worker is a small HTTP server on loopback whose answers the test switches; the other
worker is a real shoal worker."""

from __future__ import annotations

import json
import time

import httpx
import pytest

from tests.support.fleet import admin, router_config, start
from tests.support.routers import stop
from tests.support.scripted_worker import TRUNCATED_PIECES, ScriptedWorker
from tests.support.waiting import wait_for
from tests.support.workers import MODEL, spawn_worker, tiny_worker_args, wait_ready


@pytest.fixture
def pair(tiny_model_dir, shoal_cache_dir, tmp_path):
    real = wait_ready(
        *spawn_worker(
            ["--model", str(tiny_model_dir), "--dtype", "float32", "--served-model-name", MODEL, "--kv-cache", "8MiB"],
            shoal_cache_dir,
        )
    )
    scripted = ScriptedWorker()
    config = router_config(
        tmp_path,
        [real[1], scripted.url],
        policy="round_robin",
        health={"heartbeat_interval_s": 0.5, "breaker": {"failure_threshold": 3, "open_s": 1.0}},
    )
    router, url = start(config)
    yield url, scripted
    stop(router)
    real[0].kill()
    real[0].wait(timeout=30)


def breaker_of(url: str, worker: str) -> str:
    return next(w["breaker"] for w in admin(url)["workers"] if w["worker_id"] == worker)


def half_openings(url: str, worker: str) -> int:
    return sum(1 for e in admin(url)["events"] if e["worker_id"] == worker and e["change"] == "breaker_half_open")


def ask(url: str) -> httpx.Response:
    return httpx.post(
        url + "/v1/chat/completions",
        timeout=60,
        json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
    )


def test_5xx_open_the_breaker_4xx_do_not_and_a_probe_closes_it(pair):
    url, scripted = pair
    scripted.mode = "400"
    answers = [ask(url).status_code for _ in range(8)]
    assert answers.count(400) >= 3 and set(answers) == {200, 400}  # the client's own fault is passed on
    assert breaker_of(url, scripted.url) == "closed"

    scripted.mode = "500"
    assert [ask(url).status_code for _ in range(10)] == [200] * 10  # retried on the real worker
    # open, or already half-open where these requests took longer than open_s (only an open breaker
    # turns half-open)
    hits, probes = scripted.completions, half_openings(url, scripted.url)
    state = breaker_of(url, scripted.url)  # read last: a half-opening in between is counted twice, not missed
    assert state in ("open", "half_open")
    for _ in range(4):
        assert ask(url).status_code == 200
    # An open breaker gets no work: at most one probe each time it turned half-open (on a loaded
    # machine open_s may pass during these requests; the failed probe opens it again), and one for
    # the half-open period it may already be in.
    assert scripted.completions - hits <= half_openings(url, scripted.url) - probes + (state == "half_open")

    scripted.mode = "ok"
    wait_for(lambda: breaker_of(url, scripted.url) == "half_open", timeout_s=10)
    deadline = time.monotonic() + 20
    while breaker_of(url, scripted.url) != "closed" and time.monotonic() < deadline:
        assert ask(url).status_code == 200
    changes = [e["change"] for e in admin(url)["events"] if e["worker_id"] == scripted.url]
    assert changes[:2] == ["breaker_open", "breaker_half_open"] and changes[-1] == "breaker_closed"
    metrics = httpx.get(url + "/metrics").text
    assert f'shoal_router_worker_transitions_total{{change="breaker_open",worker="{scripted.url}"}}' in metrics


def test_a_critical_request_falls_back_along_the_chain_when_its_model_fails(tiny_model_dir, shoal_cache_dir, tmp_path):
    small = wait_ready(
        *spawn_worker(
            tiny_worker_args(tiny_model_dir, "small"),
            shoal_cache_dir,
        )
    )
    scripted = ScriptedWorker()  # serves MODEL, answering 500
    router, url = start(router_config(tmp_path, [scripted.url, small[1]], models={MODEL: {"fallbacks": ["small"]}}))
    try:
        request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        standard = httpx.post(url + "/v1/chat/completions", json=request, timeout=60)
        assert standard.status_code == 503 and standard.json()["error"]["type"] == "service_unavailable"
        critical = httpx.post(
            url + "/v1/chat/completions", json=request, timeout=60, headers={"x-shoal-priority": "critical"}
        )
        assert critical.status_code == 200, critical.text
        assert critical.headers["x-shoal-degraded"] == "fallback=small" and critical.json()["model"] == "small"
        assert critical.headers["x-shoal-worker"] == small[1]
    finally:
        stop(router)
        small[0].kill()
        small[0].wait(timeout=30)


def test_a_worker_that_dies_before_its_first_event_still_leaves_the_client_one_role_chunk(pair):
    """The stream broke before any event reached the client: its continuation's opening role chunk
    is the client's first, and is relayed."""
    url, scripted = pair
    scripted.mode = "cut"
    for _ in range(2):  # round robin: one of the two starts on the scripted worker
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3,
            "ignore_eos": True,  # the tiny model's sampled tokens may include its end of text
            "stream": True,
        }
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        roles = [c for e in events for c in e["choices"] if "role" in c.get("delta", {})]
        assert len(roles) == 1 and sum(len(c.get("token_ids") or []) for e in events for c in e["choices"]) == 3
    assert scripted.completions >= 1


def test_a_stream_cut_short_without_a_finish_reason_goes_on_as_text_on_a_shoal_worker(pair):
    """The stand-in streams two pieces of text without token ids and ends with a bare [DONE]; the
    router takes that for a broken stream and the shoal worker continues the text itself."""
    url, scripted = pair
    scripted.mode = "truncated"
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "temperature": 0}
    for _ in range(4):  # round robin: one of two lands on the stand-in
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
            if response.headers["x-shoal-worker"] == scripted.url:
                break
    else:
        pytest.fail("no request reached the stand-in")
    deltas = [c["delta"] for e in events for c in e["choices"]]
    text = "".join(d.get("content") or "" for d in deltas)
    relayed = "".join(TRUNCATED_PIECES)
    assert text.startswith(relayed) and sum("role" in d for d in deltas) == 1
    assert events[-1]["choices"][0]["finish_reason"] == "length"
    assert len({e["id"] for e in events}) == 1
    continued = {
        **body,
        "max_tokens": 6 - len(TRUNCATED_PIECES),
        "messages": [*body["messages"], {"role": "assistant", "content": relayed}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    [real] = [w["worker_id"] for w in admin(url)["workers"] if w["worker_id"] != scripted.url]
    answer = httpx.post(real + "/v1/chat/completions", json=continued, timeout=60).json()
    assert text == relayed + answer["choices"][0]["message"]["content"]
