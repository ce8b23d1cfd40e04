"""Hosts that vanish: a Ray cluster whose nodes are hosts of a network test bed (the Ray head and
`shoal serve` with `launcher: ray` on a control host, three worker nodes with one `accel` each), two
replicas of the tiny model. The host of the replica serving a stream vanishes (every process in it
killed, its link cut): the stream goes on, token for token, on the other replica; Ray reports the
node dead and the supervisor's replica starts again on the host left free."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from tests.support.routers import SECRET
from tests.support.serving import supervised
from tests.support.streams import read_stream, story_request
from tests.support.testbed import Host
from tests.support.waiting import answers, wait_for
from tests.support.workers import MODEL

HOSTS = ["control", "n1", "n2", "n3"]  # the network_bed fixture builds them
NODES = ("n1", "n2", "n3")
SERVE_PORT, RAY_PORT = 8080, 6379
MAX_TOKENS = 100
# Ray calls a node dead after 3 missed health checks of 1 s (set below), then the supervisor
# starts the replica again on a free node: a worker process start, on a loaded machine.
REPLACED_WITHIN_S = 120
RAY = str(Path(sys.executable).parent / "ray")


def ray_environment(cache_dir) -> dict:
    return {
        **os.environ,
        "SHOAL_CACHE_DIR": str(cache_dir),  # the kernels the test session built, on every node
        "SHOAL_CLUSTER_SECRET": SECRET,
        "RAY_health_check_initial_delay_ms": "0",
        "RAY_health_check_period_ms": "1000",
        "RAY_health_check_timeout_ms": "1000",
        "RAY_health_check_failure_threshold": "3",
    }


@pytest.fixture(scope="module")
def ray_cluster(network_bed, shoal_cache_dir, tmp_path_factory):
    """(bed, Ray address, environment, log directory) once the head and the three nodes are up."""
    bed, logs = network_bed, tmp_path_factory.mktemp("host-loss")
    env = ray_environment(shoal_cache_dir)
    control = bed["control"]
    ray_address = f"{control.address}:{RAY_PORT}"
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: socket paths are bounded
    common = ["--block", "--disable-usage-stats"]
    with open(logs / "ray-head.log", "ab") as log:
        control.popen(
            [RAY, "start", "--head", "--node-ip-address", control.address, "--port", str(RAY_PORT), "--num-cpus", "0"]
            + ["--temp-dir", temp_dir, "--include-dashboard", "false", *common],
            env=env,
            stdout=log,
            stderr=log,
        )
    wait_for(lambda: _ray_answers(control, ray_address), timeout_s=90)
    for joined, name in enumerate(NODES, 2):  # one at a time: the nodes share one file system, where
        with open(logs / f"ray-{name}.log", "ab") as log:  # each takes the next free socket name
            bed[name].popen(
                [RAY, "start", "--address", ray_address, "--node-ip-address", bed[name].address, "--num-cpus", "1"]
                + ["--resources", '{"accel": 1}', *common],
                env=env,
                stdout=log,
                stderr=log,
            )
        wait_for(lambda count=joined: _ray_nodes(control, ray_address) == count, timeout_s=120)
    return bed, ray_address, env, logs


@pytest.fixture
def serve(ray_cluster, tiny_model_dir, tmp_path):
    """Factory: `shoal serve` of the tiny model on the control host with the Ray launcher and these
    model options; returns (router URL, state directory) once it is ready. Stopped (drained) after
    the test, which frees the nodes' resources for the next."""
    bed, ray_address, env, _ = ray_cluster
    control, started = bed["control"], []

    def start(**model: object) -> tuple[str, Path]:
        config = tmp_path / "shoal.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "host": control.address,
                    "port": SERVE_PORT,
                    "launcher": "ray",
                    "ray_address": ray_address,
                    "state_dir": str(tmp_path / "state"),
                    "models": [
                        {
                            "name": MODEL,
                            "model": str(tiny_model_dir),
                            "dtype": "float32",
                            "kv_cache": "8MiB",
                            "step_delay_ms": 20,
                            "resources": {"cpus": 1, "custom": {"accel": 1}},
                            **model,
                        }
                    ],
                    "supervisor": {"restart_backoff_s": 0.5},
                    "router": {"health": {"heartbeat_interval_s": 0.5}, "failover": {"token_deadline_min_s": 1.0}},
                }
            )
        )
        command = [sys.executable, "-m", "shoal.cli", "serve", "--config", str(config)]
        with open(tmp_path / "serve.log", "ab") as log:
            started.append(control.popen(command, env=env, stderr=log))
        router = control.url(SERVE_PORT)
        wait_for(lambda: answers(router + "/ready"), timeout_s=240)
        return router, tmp_path / "state"

    yield start
    for process in started:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=90)


def _ray_status(control: Host, address: str) -> str:
    result = subprocess.run(
        control.command([RAY, "status", "--address", address]), capture_output=True, text=True, timeout=60
    )
    return result.stdout


def _ray_answers(control: Host, address: str) -> bool:
    return "Active:" in _ray_status(control, address)


def _ray_nodes(control: Host, address: str) -> int:
    status = _ray_status(control, address)
    active = status.split("Active:", 1)[-1].split("Pending:", 1)[0]
    return active.count("node_")


def host_of(bed, url: str) -> Host:
    return next(host for host in bed.hosts.values() if f"//{host.address}:" in url)


def test_a_vanished_hosts_streams_go_on_and_its_replica_starts_again_on_a_host_left(ray_cluster, serve):
    bed = ray_cluster[0]
    router, state_dir = serve(replicas=2)
    serving = {s["url"] for s in supervised(state_dir)}
    [free] = [bed[name] for name in NODES if not any(f"//{bed[name].address}:" in url for url in serving)]
    reference = read_stream(router, story_request(21, MAX_TOKENS))
    assert len(reference["ids"]) == MAX_TOKENS
    lost = {}

    def vanish(worker: str) -> None:
        lost.update(host=host_of(bed, worker), worker=worker, at=time.monotonic())
        lost["host"].vanish()

    faulted = read_stream(router, story_request(21, MAX_TOKENS), fault=vanish, after_tokens=30)
    assert faulted["ids"] == reference["ids"] and faulted["text"] == reference["text"]
    assert faulted["usage"]["completion_tokens"] == MAX_TOKENS and len(faulted["response_ids"]) == 1

    def replaced() -> list[dict]:
        return [
            s for s in supervised(state_dir) if s["state"] == "serving" and f"//{free.address}:" in (s["url"] or "")
        ]

    [replacement] = wait_for(replaced, timeout_s=REPLACED_WITHIN_S)
    assert replacement["restarts"] == 1 and replacement["last_exit"] == -9
    assert time.monotonic() - lost["at"] <= REPLACED_WITHIN_S


def stage_host(bed) -> Host:
    """The node whose namespace runs a pipeline stage server."""

    def runs_a_stage(host: Host) -> bool:
        for pid in host.pids():
            try:
                if b"shoal.parallel.pipeline_stage" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return True
            except OSError:
                pass
        return False

    [host] = [bed[name] for name in NODES if bed[name].pids() and runs_a_stage(bed[name])]
    return host


def test_a_pipeline_stage_on_a_vanished_host_is_replaced_and_its_stream_goes_on(ray_cluster, serve):
    """One replica of two stages, each process on a node of its own. The stage's host vanishes in
    the middle of a stream: the head finds the stage silent (step deadline 1 s, ping 2 s), starts a
    replacement on its own node, rebuilds its KV cache from the boundary log, and goes on."""
    bed = ray_cluster[0]
    router, state_dir = serve(
        replicas=1, pipeline_parallel_size=2, pipeline_step_deadline_s=1.0, pipeline_ping_timeout_s=2.0
    )
    lost = stage_host(bed)
    reference = read_stream(router, story_request(22, MAX_TOKENS))
    faulted = read_stream(router, story_request(22, MAX_TOKENS), fault=lambda _: lost.vanish(), after_tokens=30)
    assert faulted["ids"] == reference["ids"] and faulted["text"] == reference["text"]
    assert faulted["usage"]["completion_tokens"] == MAX_TOKENS and len(faulted["response_ids"]) == 1
    [replica] = supervised(state_dir)
    assert replica["restarts"] == 0  # the replica itself never stopped
    log = Path(replica["log"]).read_text()
    assert "pipeline stage 1 replaced: KV cache rebuilt from the boundary log" in log, log[-3000:]
