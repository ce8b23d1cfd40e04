"""Routers that die without losing streams: two routers behind HAProxy (an L4 balancer, TCP mode)
share a stream journal in Redis; HAProxy, each router, the worker and Redis run on hosts of their
own in a network test bed, the client on the machine. The router relaying a stream is killed -9 in the middle of it; the
client reconnects through HAProxy with Last-Event-ID, reaches the other router and gets the rest of
the same stream, token for token: with a plain SSE client and with the official openai client in a
small retry wrapper."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest
import yaml

from tests.support.redis_server import start_redis_server
from tests.support.routers import ADMIN_TOKEN
from tests.support.streams import story_request
from tests.support.system_commands import ensure_command
from tests.support.waiting import answers, wait_for
from tests.support.workers import MODEL, tiny_worker_args

MAX_TOKENS = 160
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}


HOSTS = ["lb", "router-a", "router-b", "worker", "redis"]  # the network_bed fixture builds them
ROUTER_PORT, WORKER_PORT, LB_PORT = 8000, 8001, 8080


@pytest.fixture(scope="module")
def cluster(network_bed, tiny_model_dir, shoal_cache_dir, tmp_path_factory):
    """Redis, a worker and HAProxy (TCP mode, health-checking both routers) on hosts of their own;
    returns (bed, HAProxy's URL, {router host name: its config file}, environment, {})."""
    bed, logs = network_bed, tmp_path_factory.mktemp("router-failover")
    _, redis_url = start_redis_server(logs, host=bed["redis"])
    worker = bed["worker"]
    args = tiny_worker_args(tiny_model_dir, MODEL, step_delay_ms=20)
    env = {**os.environ, "SHOAL_CACHE_DIR": str(shoal_cache_dir), "SHOAL_ADMIN_TOKEN": ADMIN_TOKEN}
    with open(logs / "worker.log", "ab") as log:
        command = ["worker", *args, "--host", worker.address, "--port", str(WORKER_PORT)]
        worker.popen([sys.executable, "-m", "shoal.cli", *command], env=env, stderr=log)
    configs = {}
    for name in ("router-a", "router-b"):
        configs[name] = logs / f"{name}.yaml"
        configs[name].write_text(
            yaml.safe_dump(
                {
                    "host": bed[name].address,
                    "port": ROUTER_PORT,
                    "workers": [{"url": worker.url(WORKER_PORT)}],
                    "resumable_streams": {"store": "redis", "redis_url": redis_url, "flush_tokens": 16},
                    "state": {"store": "none"},
                }
            )
        )
    servers = "\n".join(
        f"    server {name} {bed[name].address}:{ROUTER_PORT} check inter 200ms fall 2 rise 2" for name in configs
    )
    (logs / "haproxy.cfg").write_text(
        f"""global
    maxconn 256
defaults
    mode tcp
    timeout connect 2s
    timeout client 60s
    timeout server 60s
    retries 3
    option redispatch
frontend shoal
    bind {bed["lb"].address}:{LB_PORT}
    default_backend routers
backend routers
    balance roundrobin
{servers}
"""
    )
    haproxy = [ensure_command("haproxy"), "-db", "-f", str(logs / "haproxy.cfg")]
    bed["lb"].popen(haproxy, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_for(lambda: answers(worker.url(WORKER_PORT) + "/ready"), timeout_s=180)
    return bed, bed["lb"].url(LB_PORT), configs, env, {}  # the routers' processes, by host: see balanced


@pytest.fixture
def balanced(cluster):
    """(HAProxy's URL, {router URL: its process}) with both routers up: a router an earlier test
    killed is started again on its host. Both share the Redis stream journal."""
    bed, url, configs, env, processes = cluster
    for name, config in configs.items():
        if name not in processes or processes[name].poll() is not None:
            with open(config.with_suffix(".log"), "ab") as log:
                command = [sys.executable, "-m", "shoal.cli", "router", "--config", str(config)]
                processes[name] = bed[name].popen(command, env=env, stderr=log)
    for name in configs:
        wait_for(lambda host=bed[name]: answers(host.url(ROUTER_PORT) + "/health"), timeout_s=60)
    wait_for(lambda: answers(url + "/health"), timeout_s=30)
    return url, {bed[name].url(ROUTER_PORT): process for name, process in processes.items()}


def story(seed: int) -> dict:
    return story_request(seed, MAX_TOKENS)


def sse_events(url: str, body: dict, last_event_id: str | None = None) -> Iterator[tuple[str | None, dict, str]]:
    """A plain SSE client: (event id, event, router that answered) per `data:` event."""
    headers = {"last-event-id": last_event_id} if last_event_id else {}
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        router, event_id = response.headers["x-shoal-router"], None
        for line in response.iter_lines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("data: {"):
                yield event_id, json.loads(line[6:]), router


def collect(events: list[dict]) -> dict:
    ids = [t for e in events for c in e["choices"] for t in c.get("token_ids") or []]
    text = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    roles = sum("role" in c["delta"] for e in events for c in e["choices"])
    usage = [e["usage"] for e in events if e.get("usage")]
    return {"ids": ids, "text": text, "roles": roles, "response_ids": {e["id"] for e in events}, "usage": usage}


def test_a_plain_sse_client_resumes_on_the_other_router_after_its_router_is_killed(balanced):
    url, routers = balanced
    reference = collect([event for _, event, _ in sse_events(url, story(5))])
    assert len(reference["ids"]) == MAX_TOKENS
    received, last_id, killed = [], None, None
    with pytest.raises(httpx.TransportError):  # the connection dies with its router
        for event_id, event, router in sse_events(url, story(5)):
            received.append(event)
            last_id = event_id
            if killed is None and len(collect(received)["ids"]) >= 40:
                killed = routers[f"http://{router}"]
                killed.kill()
    assert killed is not None and last_id is not None
    survivors = set()
    for _, event, router in sse_events(url, story(5), last_event_id=last_id):
        received.append(event)
        survivors.add(f"http://{router}")
    assert survivors and routers[survivors.pop()] is not killed
    resumed = collect(received)
    assert resumed["ids"] == reference["ids"] and resumed["text"] == reference["text"]
    assert resumed["roles"] == 1 and len(resumed["response_ids"]) == 1
    assert resumed["usage"][-1]["completion_tokens"] == MAX_TOKENS


def resumable_chat(client: openai.OpenAI, attempts: int = 5, **request) -> Iterator:
    """The chunks of a streamed chat completion, reconnecting with the last event id when the
    connection breaks (shoal puts each event's id in the chunk's `event_id`)."""
    last = None
    for _ in range(attempts):
        headers = {"Last-Event-ID": last} if last else {}
        try:
            for chunk in client.chat.completions.create(**request, stream=True, extra_headers=headers):
                last = (chunk.model_extra or {}).get("event_id", last)
                yield chunk
            return
        except (openai.APIConnectionError, httpx.TransportError):
            continue
    raise RuntimeError(f"the stream broke {attempts} times")


def serving_router(routers: dict) -> str:
    """The router with a stream in flight (it counts it against the worker)."""

    def busy() -> str | None:
        for url, process in routers.items():
            if process.poll() is None:
                workers = httpx.get(url + "/admin/workers", headers=ADMIN, timeout=5).json()["workers"]
                if any(w["in_flight"] for w in workers):
                    return url
        return None

    return wait_for(busy, timeout_s=10)


def test_the_openai_client_in_a_retry_wrapper_resumes_after_its_router_is_killed(balanced):
    url, routers = balanced
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    request = {k: v for k, v in story(6).items() if k not in ("stream", "ignore_eos")}
    request["extra_body"] = {"ignore_eos": True}
    reference = [c for c in resumable_chat(client, **request)]
    chunks = []
    for chunk in resumable_chat(client, **request):
        chunks.append(chunk)
        if len(chunks) == 40:
            routers[serving_router(routers)].kill()

    def tokens(stream: list) -> list[int]:
        return [t for c in stream for choice in c.choices for t in (choice.model_extra or {}).get("token_ids") or []]

    def text(stream: list) -> str:
        return "".join(choice.delta.content or "" for c in stream for choice in c.choices)

    assert sum(process.poll() is not None for process in routers.values()) == 1
    assert tokens(chunks) == tokens(reference) and len(tokens(chunks)) == MAX_TOKENS
    assert text(chunks) == text(reference)
    assert {c.id for c in chunks} == {chunks[0].id}
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_a_last_event_id_that_names_no_stream_of_the_client_is_refused(balanced):
    url, _ = balanced
    [(event_id, _, _), *_] = list(sse_events(url, story(7)))
    assert event_id and event_id.endswith(":0:0")  # the role chunk: nothing generated yet
    body = story(7)
    for last_event_id, status in [("not an id", 400), ("chatcmpl-unknown:3:10", 404)]:
        refused = httpx.post(url + "/v1/chat/completions", json=body, headers={"last-event-id": last_event_id})
        assert refused.status_code == status and refused.json()["error"]["param"] == "Last-Event-ID"
    other_path = httpx.post(
        url + "/v1/completions",
        json={"model": MODEL, "prompt": "x", "max_tokens": 2, "stream": True},
        headers={"last-event-id": event_id},
    )
    assert other_path.status_code == 400 and "/v1/chat/completions" in other_path.json()["error"]["message"]
