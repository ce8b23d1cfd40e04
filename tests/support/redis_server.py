"""A real redis-server for tests: installed if missing (scripts/ensure_command.sh), started
without persistence on a free loopback port or a test bed host, stopped by the caller."""

from __future__ import annotations

import secrets
import socket
import subprocess
import time
from pathlib import Path

from tests.support.system_commands import ensure_command
from tests.support.testbed import Host
from tests.support.workers import free_port


def _answers_ping(address: str, port: int, password: str | None) -> bool:
    try:
        with socket.create_connection((address, port), timeout=1) as connection:
            connection.sendall((f"AUTH {password}\r\n" if password else "").encode() + b"PING\r\n")
            answer = b""
            while b"PONG" not in answer and b"-" not in answer:
                chunk = connection.recv(64)
                if not chunk:
                    return False
                answer += chunk
            return b"+PONG" in answer
    except OSError:
        return False


def start_redis_server(
    directory: Path, host: Host | None = None, port: int | None = None, appendonly: bool = False
) -> tuple[subprocess.Popen, str]:
    """Returns (process, redis:// URL) once the server answers PING; on `host` of a network test bed
    (port 6379 of its address, with a password in the URL, as anything reachable from other hosts
    must have) when given, else on loopback at `port` (a free one if None). With `appendonly`, every
    write goes to the AOF in `directory` before it is acknowledged (appendfsync always: with
    everysec, Redis answers while it postpones its AOF writes behind a slow fsync, for up to two
    seconds, and a kill -9 then loses them) and a server started again on the same directory has it."""
    binary = ensure_command("redis-server")
    address, port = (host.address, 6379) if host else ("127.0.0.1", port or free_port())
    password = secrets.token_hex(16) if host else None
    command = [
        binary,
        "--save",
        "",
        "--appendonly",
        "yes" if appendonly else "no",
        "--appendfsync",
        "always",
        "--port",
        str(port),
        "--bind",
        address,
        "--dir",
        str(directory),
        *(["--requirepass", password] if password else []),
    ]
    process = subprocess.Popen(
        host.command(command) if host else command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and process.poll() is None:
        if _answers_ping(address, port, password):
            return process, f"redis://{f':{password}@' if password else ''}{address}:{port}/0"
        time.sleep(0.1)
    process.kill()
    raise RuntimeError(f"redis-server did not start: {process.stderr.read().decode()[-2000:]}")
