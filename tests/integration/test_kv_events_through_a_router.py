"""A router follows its workers' KV events: a prefix computed on a worker behind the router's back
(a client that reached the worker itself) is known to the router, which sends the next request with
that prefix there, for completions and for chats; the events need the cluster secret."""

from __future__ import annotations

import time

import httpx

from tests.support.routers import SECRET, start_router, stop
from tests.support.workers import MODEL, spawn_worker, tiny_worker_args, wait_ready

HEADS = [f"Head number {i}: " + " ".join(f"w{i}x{j}" for j in range(60)) for i in range(4)]


def served_by(router_url: str, path: str, body: dict) -> str:
    response = httpx.post(router_url + path, json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.headers["x-shoal-worker"]


def test_the_router_sends_a_prefix_where_the_events_say_it_is_cached(tiny_model_dir, shoal_cache_dir):
    env = {"SHOAL_CLUSTER_SECRET": SECRET}
    workers = [
        wait_ready(*spawn_worker(tiny_worker_args(tiny_model_dir, MODEL), shoal_cache_dir, env=env)) for _ in range(2)
    ]
    urls = [url for _, url in workers]
    router, router_url = start_router(["--worker", urls[0], "--worker", urls[1]])
    try:
        assert httpx.get(urls[0] + "/shoal/kv_events", timeout=5).status_code == 401
        primed = {}
        for i, head in enumerate(HEADS):  # each head computed on one worker, reached directly
            primed[i] = urls[i % 2]
            body = {"model": MODEL, "prompt": head + "first tail", "max_tokens": 1}
            assert httpx.post(primed[i] + "/v1/completions", json=body, timeout=60).status_code == 200
            chat = {
                "model": MODEL,
                "messages": [{"role": "system", "content": head}, {"role": "user", "content": "hi"}],
            }
            assert httpx.post(primed[i] + "/v1/chat/completions", json={**chat, "max_tokens": 1}).status_code == 200
        time.sleep(1.5)  # the router opens its streams and catches up
        for i, head in enumerate(HEADS):
            completion = {"model": MODEL, "prompt": head + "another tail", "max_tokens": 1}
            assert served_by(router_url, "/v1/completions", completion) == primed[i]
        for i, head in reversed(list(enumerate(HEADS))):
            messages = [{"role": "system", "content": head}, {"role": "user", "content": "something else"}]
            chat = {"model": MODEL, "messages": messages, "max_tokens": 1}
            assert served_by(router_url, "/v1/chat/completions", chat) == primed[i]
    finally:
        stop(router)
        for process, _ in workers:
            process.terminate()
            process.wait(timeout=30)
