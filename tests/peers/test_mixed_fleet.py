"""One model name served by a shoal worker, a llama.cpp server and a vLLM CPU server, all real, behind
one shoal router: the router reads each engine's load where it exposes it, spreads requests over
all three, and carries a stream broken on a peer engine over to another engine, token-exact where a
shoal worker can take its token ids, else as text (shoal.router.streams.continuation)."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import time

import httpx
import openai
import pytest
import yaml

from shoal.model.registry import resolve_model
from tests.support.peer_engines import SERVED_NAME, PeerServer, peer_venv, start_llama_server, start_vllm_server
from tests.support.routers import router_log, start_router, stop
from tests.support.waiting import wait_for
from tests.support.workers import spawn_worker, wait_ready

ADMIN = {"authorization": "Bearer peers-admin"}
MAX_TOKENS = 48
# vLLM writes a few hundred tokens a second here: 1200 take it seconds, so its kill lands mid-output
# (within its --max-model-len of 2048 with the prompt).
LONG_TOKENS = 1200
# llama.cpp writes about 70 tokens a second here: long enough that a kill lands mid-stream.
LONG = 240


@pytest.fixture(scope="module")
def gguf():
    return resolve_model("smollm2-135m-instruct").path


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    return tmp_path_factory.mktemp("peer-logs")


@pytest.fixture(scope="module")
def shoal_worker(shoal_cache_dir, logs):
    log = (logs / "shoal.log").open("ab")
    process, url = wait_ready(
        *spawn_worker(["--served-model-name", SERVED_NAME, "--num-threads", "1"], shoal_cache_dir, stderr=log)
    )
    yield url
    process.kill()
    process.wait(timeout=30)


@pytest.fixture(scope="module")
def llama(gguf, logs):
    servers = [start_llama_server(gguf, logs / "llama.log")]
    yield servers  # a test that kills it puts a restarted one in its place
    servers[-1].kill()


@pytest.fixture(scope="module")
def vllm(gguf, logs):
    """vLLM's server, or None where vLLM could not be installed here (its tests say so)."""
    if peer_venv.installed("vllm") is None:
        yield None
        return
    server = start_vllm_server(gguf, logs / "vllm.log")
    yield server
    server.kill()


@pytest.fixture(scope="module")
def router(tmp_path_factory, logs, shoal_worker, llama, vllm):
    urls = [shoal_worker, llama[0].url] + ([vllm.url] if vllm else [])
    config = {
        "workers": [{"url": url} for url in urls],
        "policy": "session_affinity",
        # No canary generations: one makes the shoal worker busy for a moment every 10 s, and session
        # affinity's bounded load sends a key whose worker is busy on an idle fleet to its neighbour,
        # so a key picked for one engine could land on another.
        "health": {"heartbeat_interval_s": 0.5, "canary_interval_s": 3600},
        "failover": {"token_deadline_max_s": 5.0},
    }
    path = tmp_path_factory.mktemp("router") / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    process, url = start_router(["--config", str(path)], env={"SHOAL_ADMIN_TOKEN": ADMIN["authorization"][7:]})
    wait_for(lambda: all(w["engine"] is not None or w["load_source"] == "router" for w in workers(url)), 30)
    yield url
    stop(process)
    (logs / "router.log").write_text(router_log(process))


def needs_vllm(vllm: PeerServer | None) -> PeerServer:
    if vllm is None:
        pytest.skip(peer_venv.failure("vllm"))
    return vllm


def workers(router_url: str) -> list[dict]:
    return httpx.get(router_url + "/admin/workers", headers=ADMIN, timeout=10).json()["workers"]


def worker(router_url: str, url: str) -> dict:
    [found] = [w for w in workers(router_url) if w["worker_id"] == url]
    return found


def wait_idle(router_url: str) -> None:
    """Until every worker takes requests and none has anything running as the router sees it
    (reported load lags by a poll): session affinity hashes a key over the workers taking requests,
    so a peer that comes back from an earlier test's kill moves keys, and its bounded load spills
    none to a neighbour."""
    wait_for(lambda: all(w["healthy"] and w["running"] == 0 and w["in_flight"] == 0 for w in workers(router_url)), 120)


def user_for(router_url: str, target: str) -> str:
    """A session key the router's session affinity places on `target` (the fleet left idle)."""
    for i in range(200):
        wait_idle(router_url)
        user = f"user-{i}"
        response = httpx.post(
            router_url + "/v1/completions",
            json={"model": SERVED_NAME, "prompt": "Hi", "max_tokens": 1, "user": user},
            timeout=60,
        )
        assert response.status_code == 200, response.text
        if response.headers["x-shoal-worker"] == target:
            wait_idle(router_url)
            return user
    pytest.fail(f"no session key of 200 lands on {target}")


def chat_body(user: str, max_tokens: int = MAX_TOKENS) -> dict:
    return {
        "model": SERVED_NAME,
        "messages": [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}],
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "user": user,
    }


def read(router_url: str, path: str, body: dict, fault=None, after_chunks: int = 8) -> dict:
    """Streams through the router; calls fault() once `after_chunks` chunks with output arrived.
    Returns the output pieces as relayed (one per chunk), token ids, role chunks, response ids,
    the finish reason and the trace id."""
    pieces, ids, roles, response_ids, finish = [], [], 0, set(), None
    with httpx.stream("POST", router_url + path, json=body, timeout=120) as response:
        assert response.status_code == 200, response.read()
        trace_id = response.headers["x-shoal-trace-id"]
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            response_ids.add(event["id"])
            for choice in event["choices"]:
                delta = choice.get("delta") or {}
                roles += "role" in delta
                text = choice.get("text") or delta.get("content") or ""
                if text or choice.get("token_ids"):
                    pieces.append(text)
                ids += choice.get("token_ids") or []
                finish = choice.get("finish_reason") or finish
            if fault is not None and len(pieces) >= after_chunks:
                fault()
                fault = None
    return {"pieces": pieces, "ids": ids, "roles": roles, "ids_seen": response_ids, "finish": finish, "trace": trace_id}


def attempts_and_seam(router_url: str, trace_id: str) -> tuple[list[dict], int]:
    """The request's attempts in order (worker, outcome, continuation) and the output tokens relayed
    before its migration."""
    deadline = time.monotonic() + 15  # the router records a stream's spans as it winds down
    while True:
        spans = httpx.get(f"{router_url}/debug/traces/{trace_id}", headers=ADMIN, timeout=10).json()["spans"]
        roots = [s for s in spans if s["name"] == "router.request"]
        migrations = [e for root in roots for e in root["events"] if e["name"] == "migration"]
        if migrations or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert len(migrations) == 1, [(s["name"], s["attributes"], s["events"]) for s in spans]
    [migration] = migrations
    attempts = sorted((s for s in spans if s["name"] == "router.attempt"), key=lambda s: s["start_ns"])
    return [a["attributes"] for a in attempts], migration["attributes"]["shoal.tokens_so_far"]


def restart_llama(llama: list[PeerServer], gguf, logs, router_url: str) -> None:
    """A new llama.cpp server on the killed one's port, once the router has seen it come back."""
    port = int(llama[-1].url.rsplit(":", 1)[1])
    llama.append(start_llama_server(gguf, logs / "llama.log", port=port))
    wait_for(lambda: worker(router_url, llama[-1].url)["healthy"], 30)


def test_the_router_knows_each_engine_and_reads_vllm_s_load_from_its_metrics(router, shoal_worker, llama, vllm):
    assert worker(router, shoal_worker)["engine"] == "shoal"
    # llama-cpp-python's server has no /metrics: the router counts what it sent there itself.
    assert worker(router, llama[0].url)["load_source"] == "router"
    server = needs_vllm(vllm)
    assert (worker(router, server.url)["engine"], worker(router, server.url)["load_source"]) == ("vllm", "prometheus")
    assert worker(router, server.url)["served_concurrency"] is None  # its load is reported, not learned
    # A request sent to vLLM directly, past the router: only vLLM's own metrics can show it. It runs
    # its full length (a story that ends early would finish between two polls), and a busy machine
    # may hold it in vLLM's queue for a while, which its metrics report as waiting.
    body = {**chat_body("direct", 400), "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=120):
        wait_for(lambda: worker(router, server.url)["running"] + worker(router, server.url)["waiting"] >= 1, 60)
    assert worker(router, server.url)["in_flight"] == 0


def test_the_router_learns_that_llama_cpp_serves_one_request_at_a_time(llama, tmp_path):
    """Three streams sent at once to a router in front of the llama.cpp server alone: it answers
    (sends headers) one at a time, so the router records one served at once and a service time,
    which `cost` charges every request queued there."""
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump({"workers": [{"url": llama[-1].url}], "policy": "cost"}))
    process, url = start_router(["--config", str(path)], env={"SHOAL_ADMIN_TOKEN": ADMIN["authorization"][7:]})
    try:
        wait_for(lambda: worker(url, llama[-1].url)["load_source"] == "router", 30)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda i: read(url, "/v1/chat/completions", chat_body(f"queue-{i}", 24)), range(3)))
        assert all(r["finish"] == "length" for r in results)
        learned = worker(url, llama[-1].url)
        assert learned["served_concurrency"] == 1 and learned["service_s"] > 0, learned
    finally:
        stop(process)


def test_one_model_name_is_served_by_every_engine(router, shoal_worker, llama, vllm):
    client = openai.OpenAI(base_url=router + "/v1", api_key="unused", max_retries=0)
    targets = [shoal_worker, llama[0].url] + ([vllm.url] if vllm else [])
    for target in targets:
        user = user_for(router, target)
        raw = client.chat.completions.with_raw_response.create(
            model=SERVED_NAME, messages=[{"role": "user", "content": "Name a colour."}], max_tokens=8, user=user
        )
        assert raw.headers["x-shoal-worker"] == target
        assert raw.parse().choices[0].message.content
        wait_idle(router)
        streamed = read(router, "/v1/chat/completions", chat_body(user, 12))
        # Every chunk of a peer's stream reaches the client, with one role chunk.
        assert len(streamed["pieces"]) == 12 and streamed["roles"] == 1 and streamed["finish"] == "length"


def test_a_llama_cpp_chat_stream_killed_mid_output_continues_as_text(router, llama, gguf, logs):
    user = user_for(router, llama[-1].url)
    killed = read(router, "/v1/chat/completions", chat_body(user, LONG), fault=llama[-1].kill)
    restart_llama(llama, gguf, logs, router)
    clean = httpx.post(
        llama[-1].url + "/v1/chat/completions", json={**chat_body(user, LONG), "stream": False}, timeout=120
    ).json()["choices"][0]
    assert clean["finish_reason"] == "length"
    attempts, seam = attempts_and_seam(router, killed["trace"])
    assert attempts[0]["shoal.worker"] == llama[-2].url and attempts[0]["shoal.outcome"] == "broken"
    assert attempts[-1]["shoal.continuation"] == "text" and attempts[-1]["shoal.outcome"] == "done"
    assert killed["roles"] == 1 and len(killed["ids_seen"]) == 1 and killed["finish"] == "length"
    relayed, rest = "".join(killed["pieces"][:seam]), "".join(killed["pieces"][seam:])
    assert clean["message"]["content"].startswith(relayed)  # what llama.cpp said before it died, unchanged
    # The rest is exactly what the next engine says when asked to continue that text itself.
    body = chat_body(user, LONG - seam)
    body.update(stream=False, continue_final_message=True, add_generation_prompt=False)
    body["messages"] = [*body["messages"], {"role": "assistant", "content": relayed}]
    asked = httpx.post(attempts[-1]["shoal.worker"] + "/v1/chat/completions", json=body, timeout=120).json()
    assert asked["choices"][0]["message"]["content"] == rest


def test_a_llama_cpp_completion_killed_mid_output_continues_after_its_text(router, llama, gguf, logs):
    user = user_for(router, llama[-1].url)
    prompt = "The history of the lighthouse begins"
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": LONG,
        "temperature": 0,
        "stream": True,
        "user": user,
    }
    killed = read(router, "/v1/completions", body, fault=llama[-1].kill)
    restart_llama(llama, gguf, logs, router)
    attempts, seam = attempts_and_seam(router, killed["trace"])
    assert attempts[0]["shoal.worker"] == llama[-2].url and attempts[-1]["shoal.continuation"] == "text"
    relayed, rest = "".join(killed["pieces"][:seam]), "".join(killed["pieces"][seam:])
    asked = httpx.post(
        attempts[-1]["shoal.worker"] + "/v1/completions",
        json={**body, "prompt": prompt + relayed, "max_tokens": LONG - seam, "stream": False},
        timeout=120,
    ).json()
    assert asked["choices"][0]["text"] == rest


def test_a_request_is_retried_elsewhere_while_llama_cpp_has_sent_nothing(router, llama):
    user = user_for(router, llama[-1].url)
    llama[-1].process.send_signal(signal.SIGSTOP)
    try:
        started = time.monotonic()
        answered = read(router, "/v1/chat/completions", chat_body(user, 8))
    finally:
        llama[-1].process.send_signal(signal.SIGCONT)
    spans = httpx.get(f"{router}/debug/traces/{answered['trace']}", headers=ADMIN, timeout=10).json()["spans"]
    attempts = sorted((s for s in spans if s["name"] == "router.attempt"), key=lambda s: s["start_ns"])
    assert len(answered["pieces"]) == 8 and time.monotonic() - started < 60
    assert attempts[-1]["attributes"]["shoal.worker"] != llama[-1].url
    assert all(not a["attributes"]["shoal.resume"] for a in attempts)  # nothing had been sent: a plain retry


def test_a_vllm_stream_killed_mid_output_continues_token_exact_on_the_shoal_worker(router, shoal_worker, vllm):
    server = needs_vllm(vllm)
    user = user_for(router, server.url)
    long = {**chat_body(user, LONG_TOKENS), "ignore_eos": True}
    killed = read(router, "/v1/chat/completions", long, fault=server.kill)
    attempts, seam = attempts_and_seam(router, killed["trace"])
    assert attempts[0]["shoal.worker"] == server.url and attempts[0]["shoal.outcome"] == "broken"
    assert attempts[-1]["shoal.worker"] == shoal_worker and attempts[-1]["shoal.continuation"] == "tokens"
    assert len(killed["ids"]) == LONG_TOKENS and killed["roles"] == 1
    # The shoal worker went on from vLLM's own token ids: what it gives when handed them directly.
    body = {**long, "stream": False, "resume_token_ids": killed["ids"][:seam]}
    asked = httpx.post(shoal_worker + "/v1/chat/completions", json=body, timeout=120).json()
    assert asked["choices"][0]["token_ids"] == killed["ids"]  # a resumed answer repeats the ids it was handed
