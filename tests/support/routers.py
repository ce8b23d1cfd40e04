"""Real `shoal router` processes on loopback: started with the tests' cluster secret and admin
token, their logs kept for assertions."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import httpx
import pytest

from tests.support.waiting import wait_for
from tests.support.workers import free_port

SECRET = "test-cluster-secret"


ADMIN_TOKEN = "test-admin-token"


def start_router(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """Starts `shoal router ARGS` on a free port; returns once it answers /health (its static
    workers were polled during start-up). Its log goes to a temporary file, which a busy router
    cannot fill up the way it would a pipe nobody reads."""
    port = free_port()
    log = tempfile.TemporaryFile()
    process = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "router", "--port", str(port), *args],
        env={**os.environ, "SHOAL_CLUSTER_SECRET": SECRET, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=log,
    )
    url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        try:
            return httpx.get(url + "/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for(healthy, timeout_s=60)
    except AssertionError:
        process.kill()
        log.seek(0)
        pytest.fail(f"router did not start: {log.read().decode()[-2000:]}")
    process.log_file = log
    return process, url


def router_log(process: subprocess.Popen) -> str:
    """What a router started by start_router has logged so far."""
    process.log_file.seek(0)
    return process.log_file.read().decode()


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait(timeout=30)
