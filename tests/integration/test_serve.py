"""`shoal serve` end to end with a tiny model: one command brings up a router and supervised workers;
the official openai client gets an answer; `shoal status` shows the cluster; a worker killed -9 is
restarted within its backoff while requests keep succeeding; Ctrl-C drains everything and exits 0."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from tests.support.serving import (
    admin_workers,
    busy,
    healthy_workers,
    shoal,
    supervised,
)
from tests.support.waiting import wait_for


def test_one_command_serves_restarts_crashed_workers_and_stops_cleanly(deploy):
    process, url, state_dir, output = deploy(replicas=2)
    assert f"OpenAI endpoint {url}/v1" in output.read_text()
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    answer = client.chat.completions.create(  # seeded, so the random tiny model's answer is the same every run
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=8,
        seed=1,
        extra_body={"ignore_eos": True},
    )
    assert answer.choices[0].message.content and answer.usage.completion_tokens == 8

    shown = shoal("status", "--state-dir", str(state_dir))
    assert shown.returncode == 0 and shown.stdout.count("healthy") == 2, shown.stdout + shown.stderr

    victim = supervised(state_dir)[0]
    os.kill(victim["pid"], signal.SIGKILL)
    for _ in range(5):  # the other replica (and then the restarted one) keeps serving
        more = client.completions.create(model="tiny", prompt="x", max_tokens=4, extra_body={"ignore_eos": True})
        assert more.usage.completion_tokens == 4
    restarted = wait_for(
        lambda: [
            s
            for s in supervised(state_dir)
            if s["slot"] == victim["slot"] and s["restarts"] == 1 and s["state"] == "serving"
        ],
        timeout_s=60,
    )[0]
    assert restarted["pid"] != victim["pid"] and restarted["last_exit"] == -signal.SIGKILL
    wait_for(lambda: shoal("status", "--state-dir", str(state_dir)).stdout.count("healthy") == 2, timeout_s=60)
    pids = [s["pid"] for s in supervised(state_dir)]

    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=60) == 0
    assert "stopping: draining the workers" in output.read_text()
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert shoal("status", "--state-dir", str(state_dir)).returncode == 1  # nothing runs any more


def test_a_warm_spare_takes_over_faster_than_a_cold_restart(deploy):
    _, _, state_dir, _ = deploy(replicas=1, warm_spares=1)
    wait_for(lambda: [s for s in supervised(state_dir) if s["state"] == "spare"], timeout_s=120)

    def replaced_after(victims: list[dict]) -> float:
        """Seconds from killing `victims` until another worker serves in the router."""
        gone = {v["url"] for v in victims}
        killed = time.monotonic()
        for victim in victims:
            os.kill(victim["pid"], signal.SIGKILL)
        wait_for(lambda: healthy_workers(state_dir) - gone, timeout_s=120)
        return time.monotonic() - killed

    serving = [s for s in supervised(state_dir) if s["state"] == "serving"]
    promotion = replaced_after(serving)
    # Now kill everything, spare included: the only way back is a cold start.
    wait_for(lambda: len([s for s in supervised(state_dir) if s["state"] in ("serving", "spare")]) == 2, timeout_s=120)
    cold = replaced_after([s for s in supervised(state_dir) if s["pid"]])
    assert promotion < cold, (promotion, cold)


def test_a_rolling_restart_replaces_every_replica_without_failing_a_request(deploy):
    _, url, state_dir, _ = deploy(replicas=2)
    before = {s["pid"] for s in supervised(state_dir)}
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with busy(client, clients=3, max_tokens=16) as answers:
        restarted = shoal("restart", "tiny", "--state-dir", str(state_dir))
    assert restarted.returncode == 0 and "2 replicas of tiny replaced" in restarted.stdout, restarted.stdout
    after = {s["pid"] for s in supervised(state_dir)}
    assert not before & after and len(after) == 2
    assert len(answers) > 0 and set(answers) == {16}  # every request during the restart was served whole
    assert len(healthy_workers(state_dir)) == 2


def test_each_model_entry_gives_its_worker_the_kv_budget_it_says(deploy, tiny_model_dir):
    """kv_cache 1.0 is all free memory (it once became one byte), 0.5 half of it, 2GiB exactly that."""
    entries = [
        {"name": f"tiny-{i}", "model": str(tiny_model_dir), "dtype": "float32", "kv_cache": budget}
        for i, budget in enumerate([1.0, 0.5, "2GiB"])
    ]
    _, _, state_dir, _ = deploy(replicas=3, top={"models": entries})
    budgets = {}
    for worker in admin_workers(state_dir):
        load = httpx.get(worker["worker_id"] + "/load", timeout=10).json()
        budgets[load["model"]] = load["kv_cache_budget_bytes"]
    assert budgets["tiny-2"] == 2 << 30
    assert budgets["tiny-0"] > 1 << 30 and budgets["tiny-0"] > 1.5 * budgets["tiny-1"] > 0, budgets
