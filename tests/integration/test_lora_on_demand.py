"""LoRA adapters a router loads where requests need them (real router, real workers sharing one
lora_dir): an adapter catalogued `on_demand` is loaded on the worker its first request is placed on
and its next requests stay there while that worker is not busy; under a burst it is loaded on the
other worker too; a stream whose worker is killed (kill -9) goes on token-exact on a worker that
loads the adapter first; a router started again on the same state store knows the catalog; an
adapter that cannot be read fails its requests, not the workers."""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal

import httpx
import pytest
import yaml

from shoal.engine.sampling_params import SamplingParams
from tests.support.lora_adapters import tokens_with_adapter, write_adapter
from tests.support.routers import SECRET, start_router, stop
from tests.support.waiting import wait_for
from tests.support.workers import MODEL, spawn_worker, tiny_worker_args, wait_ready

ADMIN = {"authorization": "Bearer lora-admin"}
PROMPT = [5, 17, 42, 8, 99, 23, 61]


@pytest.fixture(scope="module")
def lora_dir(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("shared-lora-dir")
    for name, rank in (("a1", 4), ("a2", 8), ("a3", 4), ("a4", 8)):
        write_adapter(tiny_model_dir, root / name, rank=rank, alpha=rank + len(name))
    (root / "broken").mkdir()
    (root / "broken" / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4}))
    return root


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, shoal_cache_dir, lora_dir, tmp_path_factory):
    """(router url, router config path, {worker url: process}): two workers loading adapters from
    one lora_dir on demand, at 10 ms a step, two sequences at a time each (so a burst queues)."""
    extra = ("--enable-lora", "--max-loras", "2", "--lora-dir", str(lora_dir), "--max-num-seqs", "2")
    args = tiny_worker_args(tiny_model_dir, MODEL, *extra, step_delay_ms=10)
    workers = [wait_ready(*spawn_worker(args, shoal_cache_dir, env={"SHOAL_CLUSTER_SECRET": SECRET})) for _ in range(2)]
    state = tmp_path_factory.mktemp("router-state")
    config = state / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "workers": [{"url": url} for _, url in workers],
                "health": {"heartbeat_interval_s": 0.5},
                "failover": {"token_deadline_min_s": 1.0},
                "state": {"sqlite_path": str(state / "state.sqlite3"), "files_dir": str(state / "files")},
            }
        )
    )
    router, url = start_router(["--config", str(config)], env={"SHOAL_ADMIN_TOKEN": "lora-admin"})
    yield url, config, {worker_url: process for process, worker_url in workers}
    stop(router)
    for process, _ in workers:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def catalogue(url: str, name: str) -> None:
    change = {"lora_name": name, "lora_path": name, "on_demand": True}
    answer = httpx.post(url + "/v1/load_lora_adapter", json=change, headers=ADMIN, timeout=60)
    assert answer.status_code == 200, answer.text


def holders(workers, name: str) -> set[str]:
    """The live workers whose load report names the adapter."""
    found = set()
    for worker in workers:
        try:
            lora = httpx.get(worker + "/load", timeout=5).json()["lora"]
        except httpx.HTTPError:
            continue
        if name in lora["adapters"]:
            found.add(worker)
    return found


def body(model: str, max_tokens: int, stream: bool = False) -> dict:
    return {
        "model": model,
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": 11,
        "ignore_eos": True,
        "stream": stream,
    }


def streamed(url: str, request: dict) -> tuple[str, list[int]]:
    """(the worker that served it, its token ids) for a streamed request."""
    tokens = []
    with httpx.stream("POST", url + "/v1/completions", json=request, timeout=120) as stream:
        assert stream.status_code == 200, stream.read()
        for line in stream.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                tokens += json.loads(line[6:])["choices"][0].get("token_ids") or []
        return stream.headers["x-shoal-worker"], tokens


def expected(tiny_model_dir, shoal_cache_dir, lora_dir, name: str, max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=11, ignore_eos=True)
    return tokens_with_adapter(tiny_model_dir, shoal_cache_dir, (f"{name}={lora_dir / name}",), PROMPT, params, name)


def test_an_adapter_is_loaded_where_its_first_request_goes_and_its_next_ones_follow(
    fleet, tiny_model_dir, shoal_cache_dir, lora_dir
):
    url, _, processes = fleet
    catalogue(url, "a1")
    models = {m["id"]: m for m in httpx.get(url + "/v1/models").json()["data"]}
    assert models["a1"]["parent"] == MODEL and "parent" not in models[MODEL]
    want = expected(tiny_model_dir, shoal_cache_dir, lora_dir, "a1", 6)
    placed = set()
    for _ in range(5):
        worker, tokens = streamed(url, body("a1", 6, True))
        assert tokens == want
        placed.add(worker)
    assert len(placed) == 1  # idle workers: the one holding it is cheaper than a read
    assert holders(processes, "a1") == placed


def test_a_busy_adapter_is_loaded_on_another_worker_too(fleet):
    url, _, processes = fleet
    catalogue(url, "a2")
    assert httpx.post(url + "/v1/completions", json=body("a2", 2), timeout=60).status_code == 200
    assert len(holders(processes, "a2")) == 1
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(
            pool.map(lambda _: httpx.post(url + "/v1/completions", json=body("a2", 80), timeout=120), range(8))
        )
    assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
    assert {a.headers["x-shoal-worker"] for a in answers} == set(processes)
    assert holders(processes, "a2") == set(processes)


def test_a_router_started_again_on_its_state_store_knows_the_catalog(fleet):
    url, config, _ = fleet
    catalogue(url, "a4")
    again, again_url = start_router(["--config", str(config)], env={"SHOAL_ADMIN_TOKEN": "lora-admin"})
    try:
        answer = httpx.post(again_url + "/v1/completions", json=body("a4", 3), timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["model"] == "a4"
    finally:
        stop(again)


def test_an_adapter_that_cannot_be_read_fails_its_requests_not_the_workers(fleet):
    url, _, processes = fleet
    catalogue(url, "broken")
    answer = httpx.post(url + "/v1/completions", json=body("broken", 3), timeout=60)
    assert answer.status_code == 503, answer.text
    assert "could not load the LoRA adapter" in answer.text or "no worker" in answer.text
    for _ in range(4):
        assert httpx.post(url + "/v1/completions", json=body(MODEL, 3), timeout=60).status_code == 200
    workers = httpx.get(url + "/admin/workers", headers=ADMIN).json()["workers"]
    assert all(w["breaker"] == "closed" for w in workers), workers


def test_a_stream_killed_with_its_worker_goes_on_where_the_adapter_is_loaded_first(
    fleet, tiny_model_dir, shoal_cache_dir, lora_dir
):
    """Runs last: it kills a worker of the module's fleet."""
    url, _, processes = fleet
    catalogue(url, "a3")
    want = expected(tiny_model_dir, shoal_cache_dir, lora_dir, "a3", 120)
    tokens, killed = [], None
    with httpx.stream("POST", url + "/v1/completions", json=body("a3", 120, True), timeout=120) as stream:
        assert stream.status_code == 200
        first = stream.headers["x-shoal-worker"]
        assert holders(processes, "a3") == {first}
        for line in stream.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                tokens += choice.get("token_ids") or []
            if len(tokens) >= 20 and killed is None:
                killed = first
                os.kill(processes[first].pid, signal.SIGKILL)
    assert killed is not None
    assert tokens == want
    (survivor,) = set(processes) - {killed}
    wait_for(lambda: holders([survivor], "a3") == {survivor}, 30)
