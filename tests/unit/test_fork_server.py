"""The tests' fork server: a forked `shoal` command gets the environment, directory, streams and exit
status it would have as a fresh interpreter, and a spawn it cannot honour starts one."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.fork_server import ForkedProcess, ForkServer, start_shoal
from tests.support.waiting import wait_for


def untimed(log: bytes) -> list[bytes]:
    """A text log's lines without their timestamps."""
    return [re.sub(rb"^\S+ \S+ ", b"", line) for line in log.splitlines()]


@pytest.fixture(scope="module")
def server():
    forks = ForkServer()
    yield forks
    forks.close()


def test_a_forked_command_fails_as_a_fresh_interpreter_does(server, tmp_path):
    args = ["worker", "--model", str(tmp_path / "missing"), "--port", "1"]
    fresh = subprocess.run([sys.executable, "-m", "shoal.cli", *args], capture_output=True, timeout=120)
    log = tmp_path / "stderr"
    with open(log, "wb") as stderr:
        forked = server.spawn(args, dict(os.environ), subprocess.PIPE, stderr)
    assert isinstance(forked, ForkedProcess) and forked.pid != server.process.pid
    assert forked.wait(timeout=60) == fresh.returncode != 0
    assert forked.stdout.read() == fresh.stdout
    forked_log, fresh_log = untimed(log.read_bytes()), untimed(fresh.stderr)
    # The same log and the same error; a traceback's frames above the command are the fork server's.
    assert forked_log[0] == fresh_log[0] and forked_log[-1] == fresh_log[-1]
    assert not [line for line in forked_log if b"Warning" in line]


def test_a_forked_command_has_its_environment_and_directory_and_answers_signals(server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    log = tmp_path / "stderr"
    with open(log, "wb") as stderr:  # a router that finds its only worker down says so in the log
        process = server.spawn(
            ["router", "--port", "0", "--worker", "http://127.0.0.1:1"],
            {**os.environ, "SHOAL_LOG_FORMAT": "json"},
            None,
            stderr,
        )
    wait_for(lambda: b"down" in log.read_bytes(), timeout_s=60)
    assert all(line.startswith(b"{") for line in log.read_bytes().splitlines())  # SHOAL_LOG_FORMAT reached it
    assert Path(f"/proc/{process.pid}/cwd").resolve() == tmp_path.resolve()
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(timeout=0.2)
    assert process.poll() is None
    process.kill()
    assert process.wait(timeout=30) == -signal.SIGKILL
    process.kill()  # a reaped child is not signalled again: its pid may be another process's by now


def test_a_load_time_variable_gets_a_fresh_interpreter():
    process = start_shoal(["--help"], {**os.environ, "OMP_NUM_THREADS": "3"}, stdout=subprocess.DEVNULL)
    assert isinstance(process, subprocess.Popen)
    assert process.wait(timeout=60) == 0
