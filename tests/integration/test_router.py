"""A real router process in front of real tiny workers on loopback, driven with the openai client."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
import yaml

from tests.support.routers import ADMIN_TOKEN, SECRET, start_router, stop
from tests.support.waiting import wait_for
from tests.support.workers import MODEL, free_port, scrape, spawn_worker, wait_ready


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, shoal_cache_dir):
    """Two tiny workers at 10 ms per step and one four times slower, all serving MODEL. The delay
    keeps long requests running for seconds, so load is visible to the router."""
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--served-model-name", MODEL, "--kv-cache", "8MiB"]
    spawned = [
        spawn_worker(common + ["--step-delay-ms", "10"], shoal_cache_dir),
        spawn_worker(common + ["--step-delay-ms", "10"], shoal_cache_dir),
        spawn_worker(common + ["--step-delay-ms", "40"], shoal_cache_dir),
    ]
    started = [wait_ready(*worker) for worker in spawned]
    yield [url for _, url in started]
    for process, _ in started:
        stop(process)


@pytest.fixture
def router_for(fleet, tmp_path):
    """Factory: a router with the given policy (and its options) over the chosen workers of the fleet."""
    routers = []

    def make(policy: str, workers: list[str], **options) -> str:
        config = tmp_path / f"router-{len(routers)}.yaml"
        config.write_text(
            yaml.safe_dump({"policy": policy, "policy_options": options, "workers": [{"url": url} for url in workers]})
        )
        process, url = start_router(["--config", str(config)], env={"SHOAL_ADMIN_TOKEN": ADMIN_TOKEN})
        routers.append(process)
        return url

    yield make
    for process in routers:
        stop(process)


@pytest.fixture(scope="module")
def one_worker_router(fleet, tmp_path_factory):
    """A round-robin router over the fleet's first worker, for tests that leave no state behind."""
    config = tmp_path_factory.mktemp("one-worker-router") / "router.yaml"
    config.write_text(yaml.safe_dump({"policy": "round_robin", "workers": [{"url": fleet[0]}]}))
    process, url = start_router(["--config", str(config)])
    yield url
    stop(process)


def occupy(url: str, count: int, worker_hint: dict) -> list:
    """Starts `count` long streaming requests through the router; returns the open streams."""
    streams = []
    for i in range(count):
        body = {
            "model": MODEL,
            "prompt": f"occupy {i}",
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
            **worker_hint,
        }
        stream = httpx.stream("POST", url + "/v1/completions", json=body, timeout=60)
        response = stream.__enter__()
        streams.append((stream, response))
        assert response.status_code == 200
    return streams


def release(streams: list) -> None:
    for stream, _ in streams:
        stream.__exit__(None, None, None)


def served_by(url: str, path: str, body: dict, headers: dict | None = None) -> str:
    response = httpx.post(url + path, json=body, headers=headers, timeout=60)
    assert response.status_code == 200, response.text
    return response.headers["x-shoal-worker"]


def routers_view(url: str) -> dict[str, dict]:
    """Each worker as a router made by router_for sees it now (load, health, speeds), by worker id."""
    response = httpx.get(url + "/dashboard/api/cluster", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert response.status_code == 200, response.text
    return {w["worker_id"]: w for w in response.json()["workers"]}


def idle_in_routers_view(url: str) -> bool:
    """Every worker has reported to the router that it runs nothing, and the router sent it nothing since."""
    return all(w["running"] == w["waiting"] == w["in_flight"] == 0 for w in routers_view(url).values())


def test_openai_client_through_the_router(fleet, router_for):
    url = router_for("cost", fleet[:2])
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    assert [m.id for m in client.models.list().data] == [MODEL]
    args = dict(
        model=MODEL,
        messages=[{"role": "user", "content": "route me"}],
        max_tokens=10,
        seed=3,
        temperature=0.8,
        extra_body={"ignore_eos": True},
    )
    full = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 10 == full.usage.completion_tokens
    completion = client.completions.create(
        model=MODEL, prompt="abc", max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert len(completion.choices[0].model_extra["token_ids"]) == 4


def test_a_client_leaving_mid_stream_aborts_the_request_on_the_worker(fleet, one_worker_router):
    """400 tokens take the worker over 4 s: a request that ends as an abort was cut short."""
    url = one_worker_router

    def finished() -> Counter:
        metrics = scrape(fleet[0])
        return Counter(
            {
                reason: metrics.get(f"shoal:request_success_total[('finished_reason', '{reason}')]", 0)
                for reason in ("abort", "length", "stop")
            }
        )

    before = finished()
    body = {"model": MODEL, "prompt": "leave early", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    after = wait_for(lambda: (finished() - before) or None)
    assert after == Counter(abort=1)
    wait_for(
        lambda: (
            (metrics := scrape(fleet[0]))["shoal:num_requests_running"] == 0
            and metrics["shoal:kv_cache_usage_perc"] == 0
        )
    )


@pytest.mark.parametrize(
    "body,status",
    [
        (b"{not json", 400),
        (b"[1, 2]", 400),
        (b'{"prompt": "x"}', 400),
        (b'{"model": "nope", "prompt": "x"}', 404),
        (b'{"model": "tiny", "prompt": "x", "max_tokens": -1}', 400),
    ],
)
def test_bad_requests_get_openai_errors(one_worker_router, body, status):
    url = one_worker_router
    response = httpx.post(url + "/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == status and response.json()["error"]["code"] == status


def test_round_robin_alternates(fleet, router_for):
    url = router_for("round_robin", fleet[:2])
    body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
    picks = [served_by(url, "/v1/completions", body) for _ in range(6)]
    assert picks[0::2] == [picks[0]] * 3 and picks[1::2] == [picks[1]] * 3 and picks[0] != picks[1]


def test_session_affinity_keeps_a_user_on_one_worker(fleet, router_for):
    url = router_for("session_affinity", fleet[:2])
    wait_for(lambda: idle_in_routers_view(url))  # what earlier tests left running would weigh as load
    for user in ("alice", "bob", "carol", "dave"):
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": user}
        assert len({served_by(url, "/v1/completions", body) for _ in range(4)}) == 1
    header_picks = {
        served_by(url, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}, {"x-session-id": "s-1"})
        for _ in range(4)
    }
    assert len(header_picks) == 1


@pytest.mark.parametrize(
    ("policy", "options"),
    [
        ("cache_aware", {}),
        # The two workers are alike, but each was calibrated while other tests had the machine:
        # their figures may differ by more than the margin their step noise gives. The rule under
        # test is the margin's: a conversation stays home unless another is estimated clearly faster.
        ("cost", {"min_affinity_margin": 1.0}),
    ],
)
def test_a_conversation_follows_its_prefix_cache(fleet, router_for, policy, options):
    url = router_for(policy, fleet[:2], **options)
    system = {"role": "system", "content": "You are a tiny test model with a long shared system prompt. " * 3}
    for conversation in range(3):
        messages = [system, {"role": "user", "content": f"conversation {conversation} opens with a question"}]
        homes = set()
        for turn in range(3):
            homes.add(served_by(url, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 4}))
            messages = messages + [
                {"role": "assistant", "content": f"answer {turn} " * 4},
                {"role": "user", "content": f"follow-up number {turn}"},
            ]
        assert len(homes) == 1, (conversation, homes)


@pytest.mark.parametrize("policy", ["least_outstanding_tokens", "power_of_two"])
def test_load_policies_avoid_the_busy_worker(fleet, router_for, policy):
    url = router_for(policy, fleet[:2])
    streams = occupy(url, 1, {})
    try:
        busy = streams[0][1].headers["x-shoal-worker"]
        wait_for(lambda: routers_view(url)[busy]["running"] == 1)  # a load poll has seen it
        picks = {served_by(url, "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 2}) for _ in range(4)}
        assert busy not in picks
    finally:
        release(streams)


def test_session_affinity_yields_when_its_worker_is_overloaded(fleet, router_for):
    url = router_for("session_affinity", fleet[:2])
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "user": "erin"}
    home = served_by(url, "/v1/completions", body)
    streams = occupy(url, 4, {"user": "erin"})  # the same session piles onto its home worker
    try:
        assert all(r.headers["x-shoal-worker"] == home for _, r in streams[:2])
        assert any(r.headers["x-shoal-worker"] != home for _, r in streams)  # bounded load spills over
    finally:
        release(streams)
    wait_for(lambda: idle_in_routers_view(url))
    assert served_by(url, "/v1/completions", body) == home  # and comes back once the load is gone


def test_prefix_affinity_yields_to_load_beyond_the_thresholds(fleet, router_for):
    url = router_for("cache_aware", fleet[:2], balance_abs_threshold=2, balance_rel_threshold=1.5)
    system = {"role": "system", "content": "A long shared system prompt that makes a strong prefix. " * 4}

    def chat(question: str, **extra) -> dict:
        return {"model": MODEL, "messages": [system, {"role": "user", "content": question}], **extra}

    wait_for(lambda: idle_in_routers_view(url))  # what earlier tests left running would weigh as load
    home = served_by(url, "/v1/chat/completions", chat("first", max_tokens=2))
    wait_for(lambda: idle_in_routers_view(url))  # its report no longer counts it
    streams = []
    try:
        for i in range(3):  # same prefix, long outputs: they follow the cache to the home worker
            stream = httpx.stream(
                "POST",
                url + "/v1/chat/completions",
                json=chat(f"q{i}", max_tokens=200, ignore_eos=True, stream=True),
                timeout=60,
            )
            streams.append((stream, stream.__enter__()))
        assert [(r.status_code, r.headers["x-shoal-worker"]) for _, r in streams] == [(200, home)] * 3
        # Three in flight against none: past both thresholds, load wins over the cached prefix.
        assert served_by(url, "/v1/chat/completions", chat("q-next", max_tokens=2)) != home
    finally:
        release(streams)


def test_the_cost_policy_gives_the_fast_worker_more_work(fleet, router_for):
    """Both workers have served (their speeds are measured, not only calibrated at start-up, when
    the fleet's other workers were starting too) and the router holds the figures they report."""
    fast, slow = fleet[0], fleet[2]
    url = router_for("cost", [fast, slow])
    body = {"model": MODEL, "prompt": "spread me", "max_tokens": 24, "ignore_eos": True}
    for worker in (fast, slow):
        assert httpx.post(worker + "/v1/completions", json=body, timeout=60).status_code == 200

    def router_has_the_measured_speeds() -> bool:
        seen = routers_view(url)
        for worker in (fast, slow):
            load = httpx.get(worker + "/load").json()
            if load["running"] or any(
                seen[worker][figure] != load[figure]
                for figure in ("prefill_tokens_per_s", "decode_tokens_per_s", "capability")
            ):
                return False
        return idle_in_routers_view(url)

    wait_for(router_has_the_measured_speeds)
    with ThreadPoolExecutor(8) as pool:
        picks = Counter(pool.map(lambda _: served_by(url, "/v1/completions", body), range(48)))
    assert picks[fast] >= 2 * picks[slow], picks


def test_workers_register_with_the_secret_and_leave_when_their_lease_expires(tiny_model_dir, shoal_cache_dir):
    """Two redundant routers: the worker registers with both, and both forget it when it dies."""
    router, url = start_router(["--policy", "round_robin"])
    spare, spare_url = start_router(["--policy", "round_robin"])
    try:
        assert (
            httpx.post(
                url + "/admin/workers",
                json={"url": "http://x", "models": ["m"]},
                headers={"authorization": "Bearer wrong"},
            ).status_code
            == 401
        )
        port = free_port()
        worker = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "shoal.cli",
                "worker",
                "--port",
                str(port),
                "--model",
                str(tiny_model_dir),
                "--dtype",
                "float32",
                "--served-model-name",
                "joiner",
                "--kv-cache",
                "8MiB",
                "--router",
                url,
                "--router",
                spare_url,
            ],
            env={**os.environ, "SHOAL_CACHE_DIR": str(shoal_cache_dir), "SHOAL_CLUSTER_SECRET": SECRET},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        wait_for(
            lambda: all("joiner" in str(httpx.get(u + "/v1/models").json()) for u in (url, spare_url)), timeout_s=120
        )
        body = {"model": "joiner", "prompt": "hello", "max_tokens": 3}
        for router_url in (url, spare_url):
            assert [m["id"] for m in httpx.get(router_url + "/v1/models").json()["data"]] == ["joiner"]
            assert served_by(router_url, "/v1/completions", body) == f"http://127.0.0.1:{port}"
        worker.kill()
        worker.wait(timeout=30)
        wait_for(lambda: not any(httpx.get(u + "/v1/models").json()["data"] for u in (url, spare_url)), timeout_s=20)
        # A model this router has served is not unknown: with no worker left it is unavailable.
        gone = httpx.post(url + "/v1/completions", json=body, headers={"x-shoal-deadline-s": "0.5"})
        assert gone.status_code == 503 and "retry-after" in gone.headers
    finally:
        stop(router)
        stop(spare)
