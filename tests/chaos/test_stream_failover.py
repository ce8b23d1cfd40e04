"""Workers die (kill -9) or hang (SIGSTOP) in the middle of streams; the client's stream goes on
elsewhere and, with a seed, is token-for-token the stream of a run without the failure."""

from __future__ import annotations

import json
import os
import signal
import threading

import httpx
import pytest
import yaml

from tests.support.routers import start_router, stop
from tests.support.streams import read_stream
from tests.support.waiting import wait_for
from tests.support.workers import MODEL, scrape, spawn_worker, tiny_worker_args, wait_ready

MAX_TOKENS = 150
ADMIN = {"authorization": "Bearer failover-admin-token"}


@pytest.fixture
def pair(request, tiny_model_dir, shoal_cache_dir, tmp_path):
    """Two workers at 10 ms per step behind a router with a 1 s token deadline, routing by the policy
    given as the fixture's parameter (cost by default). They draw the seeds of unseeded requests from
    different sources, so neither could continue such a stream by chance."""
    common = tiny_worker_args(tiny_model_dir, MODEL, step_delay_ms=10)
    workers = [wait_ready(*w) for w in [spawn_worker(common + ["--seed", str(i)], shoal_cache_dir) for i in (1, 2)]]
    config = tmp_path / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "workers": [{"url": url} for _, url in workers],
                "policy": getattr(request, "param", "cost"),
                "failover": {"token_deadline_min_s": 1.0},
            }
        )
    )
    router, url = start_router(["--config", str(config)], env={"SHOAL_ADMIN_TOKEN": ADMIN["authorization"][7:]})
    yield url, {worker_url: process for process, worker_url in workers}
    stop(router)
    for process, _ in workers:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGCONT)
            process.kill()
        process.wait(timeout=30)


def chat(seed: int | None) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0.8,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return body if seed is None else {**body, "seed": seed}


def migrations(url: str) -> float:
    """Streams the router has moved to another worker mid-generation, over all models."""
    return sum(v for k, v in scrape(url).items() if k.startswith("shoal_router_migrations_total"))


def trace_spans(url: str, trace_id: str) -> list[dict]:
    return httpx.get(f"{url}/debug/traces/{trace_id}", headers=ADMIN, timeout=10).json()["spans"]


def migration_event(spans: list[dict]) -> dict:
    """The one migration event of the request's root span on the router."""
    [root] = [s for s in spans if s["name"] == "router.request"]
    [migration] = [e for e in root["events"] if e["name"] == "migration"]
    return migration


@pytest.mark.parametrize("fault_signal", [signal.SIGKILL, signal.SIGSTOP])
def test_a_stream_survives_its_worker_dying_or_hanging_token_for_token(pair, fault_signal):
    url, processes = pair
    clean = read_stream(url, chat(seed=7))
    assert len(clean["ids"]) == MAX_TOKENS
    faulty = read_stream(url, chat(seed=7), fault=lambda worker: os.kill(processes[worker].pid, fault_signal))
    assert faulty["ids"] == clean["ids"] and faulty["text"] == clean["text"]
    assert faulty["usage"]["completion_tokens"] == MAX_TOKENS and len(faulty["response_ids"]) == 1
    assert faulty["roles"] == 1
    # The trace tells the story: the first attempt broke, the migration carried the tokens so far.
    spans = trace_spans(url, faulty["trace_id"])
    migration = migration_event(spans)
    assert migration["attributes"]["shoal.worker"] == faulty["worker"]
    assert migration["attributes"]["shoal.tokens_so_far"] >= 20
    attempts = sorted((s for s in spans if s["name"] == "router.attempt"), key=lambda s: s["start_ns"])
    assert [a["attributes"]["shoal.outcome"] for a in attempts] == ["broken", "done"]
    assert attempts[1]["attributes"]["shoal.resume"] is True
    resumed = [s for s in spans if s["name"] == "worker.request" and s["parent_span_id"] == attempts[1]["span_id"]]
    assert len(resumed) == 1  # the spans of the worker that finished the stream


def test_without_a_seed_the_continuation_uses_the_drawn_one(pair):
    """The worker draws a seed for a request without one and names it in every chunk; the stream
    migrated after 20 tokens is then exactly the stream that seed gives when asked for outright."""
    url, processes = pair
    faulty = read_stream(url, chat(seed=None), fault=lambda worker: processes[worker].kill())
    assert migration_event(trace_spans(url, faulty["trace_id"]))["attributes"]["shoal.tokens_so_far"] >= 20
    [drawn] = faulty["seeds"]
    assert isinstance(drawn, int)
    asked = read_stream(url, chat(seed=drawn))
    assert faulty["ids"] == asked["ids"] and faulty["text"] == asked["text"]
    assert len(faulty["ids"]) == MAX_TOKENS and faulty["usage"]["completion_tokens"] == MAX_TOKENS


def test_a_non_streamed_request_survives_its_worker_dying(pair):
    url, processes = pair
    body = {**chat(seed=5), "stream": False}
    body.pop("stream_options")
    clean = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    migrated_before = migrations(url)
    result = []
    thread = threading.Thread(
        target=lambda: result.append(httpx.post(url + "/v1/chat/completions", json=body, timeout=60))
    )
    thread.start()

    def busy_with_tokens_out() -> str | None:
        """The worker that has generated 20 tokens of the request (its outstanding decode went down)."""
        loads = {w: httpx.get(w + "/load").json() for w in processes}
        return next(
            (
                w
                for w, load in loads.items()
                if load["running"] and load["outstanding_decode_tokens"] <= MAX_TOKENS - 20
            ),
            None,
        )

    busy = wait_for(busy_with_tokens_out, timeout_s=20)
    processes[busy].kill()
    thread.join(timeout=60)
    response = result[0]
    assert response.status_code == 200
    faulty = response.json()
    assert faulty["choices"][0]["token_ids"] == clean["choices"][0]["token_ids"]
    assert faulty["choices"][0]["message"]["content"] == clean["choices"][0]["message"]["content"]
    assert faulty["usage"] == clean["usage"] and faulty["usage"]["completion_tokens"] == MAX_TOKENS
    assert migrations(url) == migrated_before + 1
    migration = migration_event(trace_spans(url, response.headers["x-shoal-trace-id"]))
    assert migration["attributes"]["shoal.worker"] == busy and migration["attributes"]["shoal.tokens_so_far"] > 0


def test_several_choices_fail_over_each_on_its_own_and_match_a_workers_own_answer(pair):
    url, processes = pair
    body = {**chat(seed=21), "n": 3, "stream": False}
    body.pop("stream_options")
    direct = httpx.post(next(iter(processes)) + "/v1/chat/completions", json=body, timeout=60).json()
    routed = httpx.post(url + "/v1/chat/completions", json=body, timeout=60).json()
    assert [c["token_ids"] for c in routed["choices"]] == [c["token_ids"] for c in direct["choices"]]
    assert routed["usage"] == direct["usage"]

    ids: dict[int, list[int]] = {0: [], 1: [], 2: []}
    usage, killed, done = None, False, 0
    with httpx.stream(
        "POST",
        url + "/v1/chat/completions",
        timeout=60,
        json={**body, "stream": True, "stream_options": {"include_usage": True}},
    ) as response:
        for line in response.iter_lines():
            if line == "data: [DONE]":
                done += 1
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            usage = event.get("usage") or usage
            for choice in event["choices"]:
                ids[choice["index"]] += choice.get("token_ids") or []
            if not killed and sum(map(len, ids.values())) >= 60:
                processes[response.headers["x-shoal-worker"]].kill()
                killed = True
    assert killed and done == 1
    assert [ids[i] for i in range(3)] == [c["token_ids"] for c in direct["choices"]]
    assert usage == direct["usage"]


@pytest.mark.parametrize("pair", ["round_robin"], indirect=True)
def test_requests_waiting_for_their_first_byte_on_a_hung_worker_move_once_it_is_found_down(pair):
    """Worker A hangs (SIGSTOP) before the requests arrive: its kernel still accepts their
    connections, so they wait for response headers that never come (the read timeout is minutes).
    Once the router finds A down, those waits are cut short and the requests go to B. Round robin
    sends A its share: the cost policy might send all four to B on a calibration that favours it."""
    url, processes = pair
    hung = next(iter(processes))
    retried_before = retries(url)
    os.kill(processes[hung].pid, signal.SIGSTOP)
    try:
        results = []
        threads = [
            threading.Thread(target=lambda i=i: results.append(read_stream(url, chat(seed=40 + i)))) for i in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert len(results) == 4 and all(len(r["ids"]) == MAX_TOKENS for r in results)
        assert {r["worker"] for r in results} == {w for w in processes if w != hung}
        assert retries(url) > retried_before  # some were sent to A first
    finally:
        os.kill(processes[hung].pid, signal.SIGCONT)


def retries(url: str) -> float:
    return sum(v for k, v in scrape(url).items() if k.startswith("shoal_router_retries_total"))
