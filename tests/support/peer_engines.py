"""Real peer engines on loopback for `make test-peers`: llama.cpp's server (llama-cpp-python) and
vLLM's OpenAI server, from the venvs `make peers` fills (benchmarks/peer_venv.py), serving the
bundled SmolLM2 under one model name. Each runs in its own process group (vLLM starts an engine
core beside its API server), so a kill takes the whole engine down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.support.workers import free_port

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import peer_venv  # noqa: E402  (benchmarks/ holds the peers' venvs, their registry and command lines)
from peer_servers import VLLM_ENVIRONMENT, llama_server_command, vllm_server_command  # noqa: E402

SERVED_NAME = "smollm2"


@dataclass
class PeerServer:
    """One engine's server: its process group, URL and log file."""

    name: str
    process: subprocess.Popen
    url: str
    log: Path

    def kill(self) -> None:
        """kill -9 of the whole engine (API server and any engine processes it started)."""
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(timeout=30)

    def log_tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:]


def peer_python(name: str) -> Path:
    """The python of an installed peer; skips the test, saying why, where it could not be installed."""
    python = peer_venv.installed(name)
    if python is None:
        pytest.skip(peer_venv.failure(name))
    return python


def _start(name: str, argv: list[str], log: Path, port: int, env: dict[str, str], timeout_s: float) -> PeerServer:
    handle = log.open("ab")
    process = subprocess.Popen(
        argv,
        stdout=handle,
        stderr=subprocess.STDOUT,
        env={**os.environ, **env},
        start_new_session=True,
    )
    server = PeerServer(name, process, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(server.url + "/v1/models", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    server.kill()
    pytest.fail(f"{name} did not start within {timeout_s:.0f} s: {server.log_tail()}")


def start_llama_server(gguf: Path, log: Path, port: int | None = None) -> PeerServer:
    """llama.cpp's server (peer_servers.llama_server_command) on a free port unless given."""
    port = port or free_port()
    argv = llama_server_command(peer_python("llama-cpp"), gguf, SERVED_NAME, port)
    return _start("llama.cpp", argv, log, port, {}, timeout_s=120)


def start_vllm_server(gguf: Path, log: Path, port: int | None = None) -> PeerServer:
    """vLLM's OpenAI server (peer_servers.vllm_server_command) on a free port unless given."""
    port = port or free_port()
    argv = vllm_server_command(peer_python("vllm"), gguf, SERVED_NAME, port, print)
    return _start("vLLM", argv, log, port, VLLM_ENVIRONMENT, timeout_s=420)
