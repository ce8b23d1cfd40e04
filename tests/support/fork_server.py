"""`shoal worker`, `shoal router` and `shoal stage` processes forked from one that has already
imported them.

A worker spends about two seconds of CPU importing torch, FastAPI and the engine before it does
anything, and the suite starts well over a hundred of them on two cores. The fork server imports
`shoal.cli` and what its worker, router and stage commands load, once per test process; each `spawn`
forks it, and the child runs `python -m shoal.cli ARGS` as a fresh interpreter would: its own
pid, environment, working directory, standard streams and exit status. The test holds a
`ForkedProcess`, with the part of subprocess.Popen's interface the tests use.

What an interpreter or a native library reads from its environment when it loads cannot change
after the fork: a spawn whose environment differs from the server's in such a variable (the
instruction-set cap, OpenMP's and torch's settings, Python's own) starts a fresh interpreter
instead, as does any spawn once the server has gone. The wire is length-prefixed JSON on a unix
socket pair, with the child's standard streams passed as file descriptors.

Invariants: the server forks only from its main thread, before it has started any of its own;
every child it forks is reaped by it and its exit status reported to the spawner; a server whose
spawner goes away kills the children it has left and exits.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence

from shoal.config.environment import CPU_ISA_VARIABLE
from shoal.router.metrics import MULTIPROCESS_DIR_VARIABLE

# Modules a worker or a router command imports, loaded by the server before any fork.
PRELOADED = (
    "shoal.cli",
    "shoal.engine.startup",
    "shoal.worker.server",
    "shoal.worker.drain",
    "shoal.parallel.pipeline_stage",
    "shoal.router.group_runner",
    "shoal.router.config",
    "uvicorn",
    "uvloop",
)
# Environment variables read when the interpreter or a library loads: a spawn that changes one of
# these gets a fresh interpreter.
LOAD_TIME_PREFIXES = (
    CPU_ISA_VARIABLE,
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "ATEN_",
    "ONEDNN_",
    "DNNL_",
    "TORCH",
    "CUDA",
    "PYTHON",
    "LD_",
    "MALLOC",
    MULTIPROCESS_DIR_VARIABLE,
)
_LENGTH = struct.Struct("<I")
_MAX_FDS = 3


def _send(sock: socket.socket, message: dict, fds: Sequence[int] = ()) -> None:
    """One message; `fds` travel with its length prefix."""
    data = json.dumps(message).encode()
    if fds:
        socket.send_fds(sock, [_LENGTH.pack(len(data))], list(fds))
    else:
        sock.sendall(_LENGTH.pack(len(data)))
    sock.sendall(data)


def _receive(sock: socket.socket) -> tuple[dict | None, list[int]]:
    """The next message and the descriptors sent with it; (None, []) once the peer has gone."""
    header, fds, _, _ = socket.recv_fds(sock, _LENGTH.size, _MAX_FDS)
    if not header:
        return None, []
    while len(header) < _LENGTH.size:
        header += sock.recv(_LENGTH.size - len(header))
    (length,) = _LENGTH.unpack(header)
    data = b""
    while len(data) < length:
        chunk = sock.recv(length - len(data))
        if not chunk:
            return None, fds
        data += chunk
    return json.loads(data), fds


class ForkedProcess:
    """A process the fork server started: pid, args, returncode, stdout and stderr (the readable end
    of a pipe asked for with subprocess.PIPE), poll, wait, send_signal, terminate and kill."""

    def __init__(self, server: ForkServer, pid: int, args: list[str], stdout, stderr):
        self.server, self.pid, self.args = server, pid, args
        self.stdout, self.stderr = stdout, stderr
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid, timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # as Popen: never signal a pid that may have been reused
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The spawner's side: starts the server process, asks it for children, and keeps the exit
    statuses it reports (a reader thread)."""

    def __init__(self):
        ours, theirs = socket.socketpair()
        self.environment = dict(os.environ)
        self.process = subprocess.Popen(
            [sys.executable, "-c", f"from tests.support.fork_server import serve; serve({theirs.fileno()})"],
            pass_fds=[theirs.fileno()],
            env=self.environment,
            stdin=subprocess.DEVNULL,
        )
        theirs.close()
        self.sock = ours
        self.lock = threading.Lock()  # one spawn at a time: its reply is the next "spawned"
        self.spawned: queue.Queue[int | None] = queue.Queue()
        self.exits: dict[int, int] = {}
        self.changed = threading.Condition()
        self.alive = True
        threading.Thread(target=self._read, name="fork-server-reader", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                message, _ = _receive(self.sock)
            except OSError:
                message = None
            if message is None:
                with self.changed:
                    self.alive = False
                    self.changed.notify_all()
                self.spawned.put(None)
                return
            if "spawned" in message:
                self.spawned.put(message["spawned"])
            else:
                with self.changed:
                    self.exits[message["exited"]] = message["code"]
                    self.changed.notify_all()

    def serves(self, environment: dict[str, str]) -> bool:
        """Whether a child with this environment can be forked (no load-time variable differs)."""
        keys = environment.keys() | self.environment.keys()
        changed = {k for k in keys if environment.get(k) != self.environment.get(k)}
        return self.alive and not any(k.startswith(LOAD_TIME_PREFIXES) for k in changed)

    def spawn(self, args: list[str], environment: dict[str, str], stdout, stderr) -> ForkedProcess | None:
        """`python -m shoal.cli ARGS` forked with `environment`; stdout and stderr as Popen takes them
        (DEVNULL, PIPE, a file or a descriptor). None where the server cannot fork it."""
        ends, theirs = [], []
        for target, inherited in ((stdout, 1), (stderr, 2)):
            if target == subprocess.PIPE:
                read, write = os.pipe()
                ends.append(os.fdopen(read, "rb"))
                theirs.append(write)
            elif target == subprocess.DEVNULL:
                ends.append(None)
                theirs.append(os.open(os.devnull, os.O_WRONLY))
            else:  # None: this process's own stream, as Popen inherits it
                ends.append(None)
                target = inherited if target is None else target
                theirs.append(os.dup(target if isinstance(target, int) else target.fileno()))
        request = {"args": args, "env": environment, "cwd": os.getcwd()}
        try:
            with self.lock:
                _send(self.sock, request, theirs)
                pid = self.spawned.get()
        except OSError:
            pid = None
        finally:
            for fd in theirs:
                os.close(fd)
        if pid is None:
            for end in ends:
                if end is not None:
                    end.close()
            return None
        return ForkedProcess(self, pid, [sys.executable, "-m", "shoal.cli", *args], *ends)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        """The child's exit code (minus the signal that ended it) once reported, waiting at most
        `timeout` seconds (None: until then)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.changed:
            while pid not in self.exits:
                left = None if deadline is None else deadline - time.monotonic()
                if (left is not None and left <= 0) or not self.alive:
                    return self.exits.get(pid)
                self.changed.wait(left)
            return self.exits[pid]

    def close(self) -> None:
        """Ends the server, and with it the children it still has."""
        self.sock.shutdown(socket.SHUT_RDWR)
        self.process.wait(timeout=30)
        self.sock.close()


_server: ForkServer | None = None
_server_lock = threading.Lock()


def start_shoal(
    args: list[str], environment: dict[str, str], stdout=None, stderr=None
) -> ForkedProcess | subprocess.Popen:
    """`python -m shoal.cli ARGS`: forked from this test process's fork server where it can be,
    else a fresh interpreter."""
    global _server
    with _server_lock:
        if _server is None:
            _server = ForkServer()
        server = _server
    if server.serves(environment):
        process = server.spawn(args, environment, stdout, stderr)
        if process is not None:
            return process
    return subprocess.Popen([sys.executable, "-m", "shoal.cli", *args], env=environment, stdout=stdout, stderr=stderr)


def stop_fork_server() -> None:
    global _server
    with _server_lock:
        if _server is not None:
            _server.close()
            _server = None


def serve(fd: int) -> None:
    """The server: preloads, then forks a child for each request until its spawner goes away.
    Runs in the server process's main thread; a child returns from here only by raising SystemExit
    (the command's end), which ends its interpreter as `python -m` would."""
    import importlib
    import select

    for name in PRELOADED:
        importlib.import_module(name)
    sock = socket.socket(fileno=fd)
    children: dict[int, int] = {}  # pidfd -> pid
    server_pid = os.getpid()
    try:
        while True:
            readable, _, _ = select.select([sock, *children], [], [])
            for ready in readable:
                if ready is sock:
                    request, fds = _receive(sock)
                    if request is None:
                        return
                    pid = os.fork()
                    if pid == 0:
                        _become(request, fds, [sock.fileno(), *children])  # raises SystemExit
                    for received in fds:
                        os.close(received)
                    children[os.pidfd_open(pid)] = pid
                    _send(sock, {"spawned": pid})
                else:
                    pid = children.pop(ready)
                    os.close(ready)
                    _, status = os.waitpid(pid, 0)
                    _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})
    except ConnectionError:
        if os.getpid() != server_pid:
            raise  # a child's command failed: its error is its own, shown as `python -m` shows it
        # the server: its spawner went away with messages unread, as gone as after a clean close
    finally:
        if os.getpid() == server_pid:
            for pidfd, pid in children.items():
                try:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                except (ProcessLookupError, ChildProcessError):
                    pass
                os.close(pidfd)


def _become(request: dict, fds: list[int], inherited: list[int]) -> None:
    """In the forked child: takes the request's streams, environment and directory, then
    runs the command as `python -m shoal.cli` does."""
    import random
    import runpy

    for fd in inherited:
        os.close(fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (null, *fds):
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    random.seed()  # the server's generator state is every child's otherwise
    sys.argv = ["shoal.cli", *request["args"]]
    del sys.modules["shoal.cli"]  # run as `python -m` runs it: as __main__ alone (its imports stay loaded)
    runpy.run_module("shoal.cli", run_name="__main__", alter_sys=True)
    sys.exit(0)
