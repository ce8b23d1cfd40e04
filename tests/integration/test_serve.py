"""`shoal serve` end to end with a tiny model: one command brings up a router and supervised workers;
the official openai client gets an answer; `shoal status` shows the cluster; a worker killed -9 is
restarted within its backoff while requests keep succeeding; Ctrl-C drains everything and exits 0."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
import yaml

from tests.integration.test_worker_server import free_port


def wait_for(predicate, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("condition not reached in time")


def supervised(state_dir) -> list[dict]:
    path = state_dir / "serve" / "workers.json"
    return json.loads(path.read_text()) if path.exists() else []


def shoal(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shoal.cli", *args], capture_output=True, text=True, timeout=60,
                          **kwargs)


@pytest.fixture
def deploy(tiny_model_dir, shoal_cache_dir, tmp_path):
    """Factory: `shoal serve` of the tiny model with `replicas` and `warm_spares`; returns (process,
    endpoint, state directory, output file)."""
    started = []

    def start(replicas: int, warm_spares: int = 0, router: dict | None = None, **model_options):
        port = free_port()
        config = tmp_path / "shoal.yaml"
        config.write_text(yaml.safe_dump({
            "port": port, "state_dir": str(tmp_path / "state"),
            "models": [{"name": "tiny", "model": str(tiny_model_dir), "replicas": replicas,
                        "warm_spares": warm_spares, "dtype": "float32", "kv_cache": "8MiB", "drain_grace_s": 5,
                        **model_options}],
            "supervisor": {"restart_backoff_s": 0.5}, **({"router": router} if router else {})}))
        output = tmp_path / "serve.out"
        with open(output, "wb") as out:
            process = subprocess.Popen([sys.executable, "-m", "shoal.cli", "serve", "--config", str(config)],
                                       env={**os.environ, "SHOAL_CACHE_DIR": str(shoal_cache_dir)}, stdout=out,
                                       stderr=subprocess.STDOUT)
        started.append(process)
        wait_for(lambda: f"ready: {replicas} workers serving" in output.read_text(), timeout_s=180)
        return process, f"http://127.0.0.1:{port}", tmp_path / "state", output

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=30)
    for slot in supervised(tmp_path / "state"):
        if slot["pid"]:
            try:
                os.kill(slot["pid"], signal.SIGKILL)
            except ProcessLookupError:
                pass


def admin_workers(state_dir) -> list[dict]:
    serve = json.loads((state_dir / "serve" / "serve.json").read_text())
    return httpx.get(serve["url"] + "/admin/workers", timeout=10,
                     headers={"authorization": f"Bearer {serve['admin_token']}"}).json()["workers"]


def healthy_workers(state_dir) -> set[str]:
    return {w["worker_id"] for w in admin_workers(state_dir) if w["healthy"]}


def test_one_command_serves_restarts_crashed_workers_and_stops_cleanly(deploy):
    process, url, state_dir, output = deploy(replicas=2)
    assert f"OpenAI endpoint {url}/v1" in output.read_text()
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    answer = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hello"}],
                                            max_tokens=8)
    assert answer.choices[0].message.content and answer.usage.completion_tokens == 8

    shown = shoal("status", "--state-dir", str(state_dir))
    assert shown.returncode == 0 and shown.stdout.count("healthy") == 2, shown.stdout + shown.stderr

    victim = supervised(state_dir)[0]
    os.kill(victim["pid"], signal.SIGKILL)
    for _ in range(5):  # the other replica (and then the restarted one) keeps serving
        assert client.completions.create(model="tiny", prompt="x", max_tokens=4).usage.completion_tokens == 4
    restarted = wait_for(lambda: [s for s in supervised(state_dir) if s["slot"] == victim["slot"]
                                  and s["restarts"] == 1 and s["state"] == "serving"], timeout_s=60)[0]
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
    wait_for(lambda: len([s for s in supervised(state_dir) if s["state"] in ("serving", "spare")]) == 2,
             timeout_s=120)
    cold = replaced_after([s for s in supervised(state_dir) if s["pid"]])
    assert promotion < cold, (promotion, cold)


def test_a_rolling_restart_replaces_every_replica_without_failing_a_request(deploy):
    _, url, state_dir, _ = deploy(replicas=2)
    before = {s["pid"] for s in supervised(state_dir)}
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    answers, done = [], threading.Event()

    def load() -> None:
        while not done.is_set():
            try:
                answers.append(client.completions.create(model="tiny", prompt="x", max_tokens=16,
                                                         extra_body={"ignore_eos": True}).usage.completion_tokens)
            except openai.OpenAIError as exc:  # recorded, so that the assertion below names it
                answers.append(exc)

    threads = [threading.Thread(target=load) for _ in range(3)]
    for thread in threads:
        thread.start()
    try:
        restarted = shoal("restart", "tiny", "--state-dir", str(state_dir))
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=60)
    assert restarted.returncode == 0 and "2 replicas of tiny replaced" in restarted.stdout, restarted.stdout
    after = {s["pid"] for s in supervised(state_dir)}
    assert not before & after and len(after) == 2
    assert len(answers) > 0 and set(answers) == {16}  # every request during the restart was served whole
    assert len(healthy_workers(state_dir)) == 2
