"""A real redis-server for tests: installed if missing (scripts/ensure_redis_server.sh), started
on a free loopback port without persistence, stopped by the caller."""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path

from tests.support.workers import free_port

ENSURE_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "ensure_redis_server.sh"


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as connection:
            connection.sendall(b"PING\r\n")
            return connection.recv(16).startswith(b"+PONG")
    except OSError:
        return False


def start_redis_server(directory: Path) -> tuple[subprocess.Popen, str]:
    """Returns (process, redis:// URL) once the server answers PING."""
    binary = (
        subprocess.run([str(ENSURE_SCRIPT)], check=True, capture_output=True, text=True, timeout=600)
        .stdout.strip()
        .splitlines()[-1]
    )
    port = free_port()
    process = subprocess.Popen(
        [
            binary,
            "--save",
            "",
            "--appendonly",
            "no",
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(directory),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process.poll() is None:
        if _answers_ping(port):
            return process, f"redis://127.0.0.1:{port}/0"
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"redis-server did not start: {process.stderr.read().decode()[-2000:]}")
