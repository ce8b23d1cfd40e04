"""A worker that answers errors: 5xx open its circuit breaker (requests succeed elsewhere, the client
never sees the 500), 4xx never do; once it answers properly again a half-open probe closes it.

The failing worker is a small HTTP server on loopback whose answers the test switches; the other
worker is a real shoal worker."""
from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from aiohttp import web

from tests.chaos.fleet import admin, router_config, start
from tests.integration.test_router import stop
from tests.integration.test_worker_server import MODEL, free_port, spawn_worker, wait_ready
from tests.waiting import wait_for


class ScriptedWorker:
    """Serves /v1/models; answers completions with `mode`: "500", "400", "ok" (a one-token SSE
    stream) or "cut" (the stream's headers, then the connection closes before any event)."""

    def __init__(self):
        self.mode = "500"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.completions = 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._complete)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        ready.set()
        self.loop.run_forever()

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.completions += 1
        if self.mode == "cut":
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            request.transport.close()
            return response
        if self.mode != "ok":
            status = int(self.mode)
            return web.json_response({"error": {"message": f"scripted {status}", "type": "x", "code": status}},
                                     status=status)
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        chunk = {"id": "chatcmpl-scripted", "object": "chat.completion.chunk", "model": MODEL,
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}],
                 "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
        return response


@pytest.fixture
def pair(tiny_model_dir, shoal_cache_dir, tmp_path):
    real = wait_ready(*spawn_worker(["--model", str(tiny_model_dir), "--dtype", "float32", "--served-model-name",
                                     MODEL, "--kv-cache", "8MiB"], shoal_cache_dir))
    scripted = ScriptedWorker()
    config = router_config(tmp_path, [real[1], scripted.url], policy="round_robin",
                           health={"heartbeat_interval_s": 0.5, "breaker": {"failure_threshold": 3, "open_s": 1.0}})
    router, url = start(config)
    yield url, scripted
    stop(router)
    real[0].kill()
    real[0].wait(timeout=30)


def breaker_of(url: str, worker: str) -> str:
    return next(w["breaker"] for w in admin(url)["workers"] if w["worker_id"] == worker)


def ask(url: str) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3})


def test_5xx_open_the_breaker_4xx_do_not_and_a_probe_closes_it(pair):
    url, scripted = pair
    scripted.mode = "400"
    answers = [ask(url).status_code for _ in range(8)]
    assert answers.count(400) >= 3 and set(answers) == {200, 400}  # the client's own fault is passed on
    assert breaker_of(url, scripted.url) == "closed"

    scripted.mode = "500"
    assert [ask(url).status_code for _ in range(10)] == [200] * 10  # retried on the real worker
    assert breaker_of(url, scripted.url) == "open"
    hits = scripted.completions
    for _ in range(4):
        assert ask(url).status_code == 200
    assert scripted.completions == hits  # an open breaker gets no work

    scripted.mode = "ok"
    wait_for(lambda: breaker_of(url, scripted.url) == "half_open", timeout_s=10)
    deadline = time.monotonic() + 20
    while breaker_of(url, scripted.url) != "closed" and time.monotonic() < deadline:
        assert ask(url).status_code == 200
    changes = [e["change"] for e in admin(url)["events"] if e["worker_id"] == scripted.url]
    assert changes[:2] == ["breaker_open", "breaker_half_open"] and changes[-1] == "breaker_closed"
    metrics = httpx.get(url + "/metrics").text
    assert f'shoal_router_worker_transitions_total{{change="breaker_open",worker="{scripted.url}"}}' in metrics


def test_a_critical_request_falls_back_along_the_chain_when_its_model_fails(tiny_model_dir, shoal_cache_dir,
                                                                             tmp_path):
    small = wait_ready(*spawn_worker(["--model", str(tiny_model_dir), "--dtype", "float32", "--served-model-name",
                                      "small", "--kv-cache", "8MiB"], shoal_cache_dir))
    scripted = ScriptedWorker()  # serves MODEL, answering 500
    router, url = start(router_config(tmp_path, [scripted.url, small[1]], models={MODEL: {"fallbacks": ["small"]}}))
    try:
        request = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
        standard = httpx.post(url + "/v1/chat/completions", json=request, timeout=60)
        assert standard.status_code == 503 and standard.json()["error"]["type"] == "service_unavailable"
        critical = httpx.post(url + "/v1/chat/completions", json=request, timeout=60,
                              headers={"x-shoal-priority": "critical"})
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
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines()
                      if line.startswith("data: {")]
        roles = [c for e in events for c in e["choices"] if "role" in c.get("delta", {})]
        assert len(roles) == 1 and sum(len(c.get("token_ids") or []) for e in events for c in e["choices"]) == 3
    assert scripted.completions >= 1
