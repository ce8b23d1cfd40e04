"""Real `shoal router` processes on loopback (forked from the fork server where they can be): started
with the tests' cluster secret and admin token, their logs kept for assertions."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import httpx
import pytest
import yaml

from tests.support.fork_server import start_shoal
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
    process = start_shoal(
        ["router", "--port", str(port), *args],
        {**os.environ, "SHOAL_CLUSTER_SECRET": SECRET, **(env or {})},
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


class RouterFactory:
    """Routers started from one base config (each with its own overrides: a top-level mapping in
    them is merged into the base's), all stopped by stop_all."""

    def __init__(self, directory: Path, base: dict):
        self.directory = directory
        self.base = base
        self.started: list[subprocess.Popen] = []

    def start(self, overrides: dict | None = None) -> tuple[subprocess.Popen, str]:
        config = dict(self.base)
        for key, value in (overrides or {}).items():
            config[key] = {**config[key], **value} if isinstance(value, dict) and key in config else value
        path = self.directory / f"router-{len(self.started)}.yaml"
        path.write_text(yaml.safe_dump(config))
        process, url = start_router(["--config", str(path)])
        self.started.append(process)
        return process, url

    def stop_all(self) -> None:
        for process in self.started:
            if process.poll() is None:
                stop(process)
