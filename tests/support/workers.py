"""Real `shoal worker` processes on loopback ports: start them, wait for them, read their metrics."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.fork_server import ForkedProcess, start_shoal

MODEL = "tiny"


# Ports below the kernel's ephemeral range (net.ipv4.ip_local_port_range starts at 32768): the
# kernel never hands them to a client connection or to a bind to port 0, so a port chosen here stays
# free until the process it is meant for binds it. Each pytest process walks its own stride.
_LOW_PORTS = range(15000, 32700)
_next_low_port = _LOW_PORTS.start + (os.getpid() * 7919) % len(_LOW_PORTS)


def free_port() -> int:
    """A loopback port that is free now and that nothing else on the machine will be given meanwhile
    (below the ephemeral range; a port in use is skipped)."""
    global _next_low_port
    for _ in range(len(_LOW_PORTS)):
        port = _next_low_port
        _next_low_port = _LOW_PORTS.start + (port + 1 - _LOW_PORTS.start) % len(_LOW_PORTS)
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free loopback port below the ephemeral range")


def tiny_worker_args(
    model_dir, served_name: str, *extra: str, step_delay_ms: int | None = None, kv_cache: str = "8MiB"
) -> list[str]:
    """`shoal worker` arguments for the tiny test model in float32 served as `served_name`, with a
    small KV cache, steps of at least `step_delay_ms` when given, then `extra`."""
    delay = ["--step-delay-ms", str(step_delay_ms)] if step_delay_ms is not None else []
    return [
        "--model",
        str(model_dir),
        "--dtype",
        "float32",
        "--served-model-name",
        served_name,
        "--kv-cache",
        kv_cache,
        *delay,
        *extra,
    ]


def spawn_worker(
    args: list[str], cache_dir, port: int | None = None, stderr=subprocess.PIPE, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen | ForkedProcess, str]:
    """Launches `shoal worker ARGS` on a loopback port (a free one unless given) without waiting for
    it, with `env` added to its environment (forked from the fork server where it can be)."""
    port = port or free_port()
    process = start_shoal(
        ["worker", "--port", str(port), *args],
        {**os.environ, "SHOAL_CACHE_DIR": str(cache_dir), **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )
    return process, f"http://127.0.0.1:{port}"


def wait_ready(process: subprocess.Popen, url: str, log_path=None) -> tuple[subprocess.Popen, str]:
    """Returns once the worker's /ready answers 200; fails the test with the tail of its stderr (or of
    `log_path`, where its stderr went) if it never does."""
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    if process.stderr:
        log = process.stderr.read().decode()[-2000:]
    else:
        log = open(log_path, "rb").read().decode()[-2000:] if log_path else "(its log went to a file)"
    pytest.fail(f"worker did not start: {log}")


def start_worker(args: list[str], cache_dir) -> tuple[subprocess.Popen, str]:
    """Starts `shoal worker ARGS` on a free loopback port; returns once /ready answers 200."""
    return wait_ready(*spawn_worker(args, cache_dir))


def scrape(url: str) -> dict[str, float]:
    """/metrics as {series name with labels: value}, label-free names for single series."""
    values = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in ("model_name", "le")}
            key = sample.name + ("" if not labels else str(sorted(labels.items())))
            if "le" not in sample.labels:
                values[key] = sample.value
    return values
