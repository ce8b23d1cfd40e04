"""The `deploy` fixture: `shoal serve` of the tiny model, stopped (workers too) after the test."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import yaml

from tests.integration.serving import supervised
from tests.integration.test_worker_server import free_port
from tests.waiting import wait_for


@pytest.fixture
def deploy(tiny_model_dir, shoal_cache_dir, tmp_path):
    """Factory: `shoal serve` of the tiny model with `replicas`, `warm_spares`, other model options,
    `router` settings and other `top`-level settings; returns (process, endpoint, state directory,
    output file) once the replicas serve."""
    started = []

    def start(replicas: int, warm_spares: int = 0, router: dict | None = None, top: dict | None = None,
              **model_options):
        port = free_port()
        config = tmp_path / "shoal.yaml"
        config.write_text(yaml.safe_dump({
            "port": port, "state_dir": str(tmp_path / "state"),
            "models": [{"name": "tiny", "model": str(tiny_model_dir), "replicas": replicas,
                        "warm_spares": warm_spares, "dtype": "float32", "kv_cache": "8MiB", "drain_grace_s": 5,
                        **model_options}],
            "supervisor": {"restart_backoff_s": 0.5}, **({"router": router} if router else {}), **(top or {})}))
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
