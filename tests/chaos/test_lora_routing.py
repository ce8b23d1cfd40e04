"""Requests for a LoRA adapter through a real router go only to the workers that hold it (their load
reports name their adapters), and a stream whose worker is killed (kill -9) mid-way goes on,
token-exact, on another worker that holds it."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest
import yaml

from shoal.engine.sampling_params import SamplingParams
from tests.support.lora_adapters import tokens_with_adapter, write_adapter
from tests.support.routers import start_router, stop
from tests.support.waiting import wait_for
from tests.support.workers import MODEL, spawn_worker, tiny_worker_args, wait_ready

PROMPT = [5, 17, 42, 8, 99, 23, 61]
MAX_TOKENS = 120


@pytest.fixture
def fleet(tiny_model_dir, shoal_cache_dir, tmp_path):
    """(router url, {worker url: process}, adapter directory): two workers holding adapter a0, one
    without, at 10 ms a step."""
    adapter = tmp_path / "a0"
    write_adapter(tiny_model_dir, adapter)
    holding = ["--enable-lora", "--lora-modules", f"a0={adapter}"]
    specs = [holding, holding, []]
    workers = [
        wait_ready(*spawn_worker(tiny_worker_args(tiny_model_dir, MODEL, *extra, step_delay_ms=10), shoal_cache_dir))
        for extra in specs
    ]
    config = tmp_path / "router.yaml"
    config.write_text(
        yaml.safe_dump({"workers": [{"url": url} for _, url in workers], "failover": {"token_deadline_min_s": 1.0}})
    )
    router, url = start_router(["--config", str(config)])
    wait_for(lambda: "a0" in {m["id"] for m in httpx.get(url + "/v1/models").json()["data"]}, 30)
    yield url, {worker_url: process for process, worker_url in workers}, adapter
    stop(router)
    for process, _ in workers:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


def body(stream: bool) -> dict:
    return {
        "model": "a0",
        "prompt": PROMPT,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.8,
        "seed": 7,
        "ignore_eos": True,
        "stream": stream,
    }


def test_adapter_requests_go_to_its_workers_and_survive_kill_9(fleet, tiny_model_dir, shoal_cache_dir):
    url, processes, adapter = fleet
    holders = list(processes)[:2]
    for _ in range(6):
        answer = httpx.post(url + "/v1/completions", json={**body(False), "max_tokens": 4}, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.headers["x-shoal-worker"] in holders and answer.json()["model"] == "a0"
    params = SamplingParams(temperature=0.8, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True)
    expected = tokens_with_adapter(tiny_model_dir, shoal_cache_dir, (f"a0={adapter}",), PROMPT, params, "a0")
    ids = []
    with httpx.stream("POST", url + "/v1/completions", json=body(True), timeout=120) as response:
        assert response.status_code == 200
        victim, killed = response.headers["x-shoal-worker"], False
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            ids += event["choices"][0].get("token_ids") or []
            if len(ids) >= 30 and not killed:
                os.kill(processes[victim].pid, signal.SIGKILL)
                killed = True
    assert killed and ids == expected
