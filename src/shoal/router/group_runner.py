"""How `shoal router` runs: one process, or a group of `processes` members on one port.

Each member of a group is a whole router (router.app) listening on its own SO_REUSEPORT socket, so
the kernel spreads client connections across members and the relay scales with cores;
shoal.router.group.sync keeps their routing one. The group's parent only starts, restarts and stops
members: it makes the group's private directory (mode 0700: the members' channel sockets and the
admission slot table) and a random token the members prove to each other.

Invariants: a member that dies is started again after RESTART_BACKOFF_S, its slots zeroed first;
the group stops when its parent is told to (SIGTERM, SIGINT) and removes its directory.
"""

from __future__ import annotations

import gc
import logging
import multiprocessing
import os
import secrets
import shutil
import signal
import socket
import tempfile
import time
from pathlib import Path

import uvicorn

from shoal.observability.logging import configure_logging
from shoal.router.admission.slots import GroupSlots
from shoal.router.app import create_router_app
from shoal.router.config import RouterConfig
from shoal.router.group.sync import GroupMember, metrics_directory
from shoal.router.metrics import MULTIPROCESS_DIR_VARIABLE

log = logging.getLogger(__name__)
# A request makes hundreds of short-lived objects; with CPython's default first threshold (700)
# the collector ran many times a second in the relay. Cycles are rare there, so it runs less.
GC_THRESHOLDS = (50_000, 20, 20)
# No access log, no `server` header, and clients' addresses as the socket says (the router reads no
# X-Forwarded-For): less work on every request.
UVICORN_SETTINGS = {"log_level": "warning", "access_log": False, "server_header": False, "proxy_headers": False}
RESTART_BACKOFF_S = 1.0
STOP_TIMEOUT_S = 10.0


def serve_router(config: RouterConfig) -> int:
    """Runs the router until it is stopped; returns the exit status."""
    if config.processes == 1:
        app = create_router_app(config)
        _prepare_process()
        uvicorn.run(app, host=config.host, port=config.port, **UVICORN_SETTINGS)
        return 0
    return _serve_group(config)


def _prepare_process() -> None:
    gc.freeze()  # what start-up built lives as long as the process: the collector need not scan it
    gc.set_threshold(*GC_THRESHOLDS)


def _serve_group(config: RouterConfig) -> int:
    try:  # nobody else listens there (not even another group, which could share it otherwise)
        _listening_socket(config, shared=False).close()
    except OSError as exc:
        log.error("cannot listen on %s:%s: %s", config.host, config.port, exc)
        return 2
    directory = Path(tempfile.mkdtemp(prefix="shoal-router-group-"))
    token = secrets.token_bytes(32)
    GroupSlots.create(directory / "admission-slots", config.processes)
    slots = GroupSlots(directory / "admission-slots", None, config.processes)
    # Read by prometheus_client when a member imports it: every member's counters and histograms go
    # to files there, which any member sums when scraped (router.metrics).
    metrics_directory(directory).mkdir()
    os.environ[MULTIPROCESS_DIR_VARIABLE] = str(metrics_directory(directory))
    spawn = multiprocessing.get_context("spawn")
    stopping = False

    def stop(signum, frame) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def start(member: int) -> multiprocessing.Process:
        seat = GroupMember(directory, member, config.processes, token)
        process = spawn.Process(target=_serve_member, args=(config, seat), name=f"shoal-router-{member}")
        process.start()
        return process

    members = [start(i) for i in range(config.processes)]
    log.info("router group of %d processes on %s:%d", config.processes, config.host, config.port)
    try:
        while not stopping:
            time.sleep(0.2)
            for i, process in enumerate(members):
                if process.is_alive() or stopping:
                    continue
                log.warning("router member %d exited with %s; starting it again", i, process.exitcode)
                slots.clear(i)
                time.sleep(RESTART_BACKOFF_S)
                members[i] = start(i)
    finally:
        for process in members:
            process.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for process in members:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.kill()
        shutil.rmtree(directory, ignore_errors=True)
    return 0


def _serve_member(config: RouterConfig, seat: GroupMember) -> None:
    configure_logging()
    app = create_router_app(config, seat)
    _prepare_process()
    server = uvicorn.Server(uvicorn.Config(app, **UVICORN_SETTINGS))
    server.run(sockets=[_listening_socket(config)])


def _listening_socket(config: RouterConfig, shared: bool = True) -> socket.socket:
    """A socket on the router's address; `shared`, one the other members' sockets share
    (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in config.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if shared:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((config.host, config.port))
    sock.listen(2048)
    return sock
