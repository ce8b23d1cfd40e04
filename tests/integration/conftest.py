"""Fixtures of the integration tests: `deploy` (`shoal serve` of the tiny model, stopped with its
workers after the test), one tiny worker shared by the whole session (`worker_url`), and a router
in front of a real worker and a failing one, all exporting traces (`traced_fleet`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import yaml

from tests.support.fleet import ADMIN, router_config
from tests.support.otlp_collector import OtlpCollector
from tests.support.routers import start_router, stop
from tests.support.scripted_worker import ScriptedWorker
from tests.support.serving import supervised
from tests.support.waiting import wait_for
from tests.support.workers import MODEL, free_port, spawn_worker, start_worker, tiny_worker_args, wait_ready


@pytest.fixture
def deploy(tiny_model_dir, shoal_cache_dir, tmp_path):
    """Factory: `shoal serve` of the tiny model with `replicas`, `warm_spares`, other model options,
    `router` settings and other `top`-level settings; returns (process, endpoint, state directory,
    output file) once the replicas serve."""
    started = []

    def start(
        replicas: int, warm_spares: int = 0, router: dict | None = None, top: dict | None = None, **model_options
    ):
        port = free_port()
        config = tmp_path / "shoal.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "port": port,
                    "state_dir": str(tmp_path / "state"),
                    "models": [
                        {
                            "name": "tiny",
                            "model": str(tiny_model_dir),
                            "replicas": replicas,
                            "warm_spares": warm_spares,
                            "dtype": "float32",
                            "kv_cache": "8MiB",
                            "drain_grace_s": 5,
                            **model_options,
                        }
                    ],
                    "supervisor": {"restart_backoff_s": 0.5},
                    **({"router": router} if router else {}),
                    **(top or {}),
                }
            )
        )
        output = tmp_path / "serve.out"
        with open(output, "wb") as out:
            process = subprocess.Popen(
                [sys.executable, "-m", "shoal.cli", "serve", "--config", str(config)],
                env={**os.environ, "SHOAL_CACHE_DIR": str(shoal_cache_dir)},
                stdout=out,
                stderr=subprocess.STDOUT,
            )
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


@pytest.fixture
def traced_fleet(tiny_model_dir, shoal_cache_dir, tmp_path):
    collector = OtlpCollector()
    real = wait_ready(
        *spawn_worker(
            tiny_worker_args(tiny_model_dir, MODEL, "--otlp-endpoint", collector.endpoint),
            shoal_cache_dir,
        )
    )
    scripted = ScriptedWorker()  # answers 500
    router, url = start_router(
        [
            "--config",
            router_config(
                tmp_path, [scripted.url, real[1]], policy="round_robin", tracing={"otlp_endpoint": collector.endpoint}
            ),
        ],
        env={"SHOAL_ADMIN_TOKEN": ADMIN["authorization"][7:], "SHOAL_LOG_FORMAT": "json"},
    )
    yield url, scripted.url, real[1], collector, router.log_file
    stop(router)
    real[0].kill()
    real[0].wait(timeout=30)
    collector.close()


@pytest.fixture(scope="session")
def worker_url(tiny_model_dir, shoal_cache_dir):
    process, url = start_worker(
        ["--model", str(tiny_model_dir), "--dtype", "float32", "--served-model-name", MODEL, "--kv-cache", "8MiB"],
        shoal_cache_dir,
    )
    yield url
    process.terminate()
    process.wait(timeout=30)
