"""The head's links to its pipeline stages: its inbox, bound where every stage can reach it, and a
handle per stage server (a local process it started, or a `shoal stage` at an address)."""
from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import socket
import subprocess
import sys
import time

import zmq

from shoal.engine.config import EngineConfig
from shoal.errors import ReplicaFailedError
from shoal.parallel.stage_messages import Probe, Profiled, receive, send
from shoal.parallel.stage_profile import NodeProfile
from shoal.processes import die_with_parent, free_port


def address_host(address: str) -> str:
    """The host of a ZeroMQ tcp address (tcp://HOST:PORT)."""
    return address.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def head_host(stage_addresses: tuple[str, ...]) -> str:
    """Where the head binds its inbox: loopback when every stage server is on this host, else this
    host's address on the route to the first one that is not (no packet is sent to find it)."""
    for address in stage_addresses:
        host = address_host(address)
        if not is_loopback(host):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as route:
                route.connect((host, 9))
                return route.getsockname()[0]
    return "127.0.0.1"


class StageHandle:
    """The head's link to one stage server. `ident` is unique per handle (replies carry it); `stage`
    is the stage it holds the layers of (None until set up)."""

    def __init__(self, context: zmq.Context, ident: int, address: str | None = None):
        self.ident = ident
        self.stage: int | None = None
        self.process = None
        if address is None:
            address = f"tcp://127.0.0.1:{free_port()}"
            self.process = subprocess.Popen([sys.executable, "-m", "shoal.parallel.pipeline_stage", "--bind", address],
                                            preexec_fn=die_with_parent)
        self.inbox = address
        self.control = context.socket(zmq.PUSH)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.connect(address)

    def alive(self) -> bool:
        """False once a local process has exited; a remote one counts as alive until it fails a ping."""
        return self.process is None or self.process.poll() is None

    def close(self) -> None:
        if self.process is not None:
            if self.alive():
                self.process.kill()
            self.process.wait()
        self.control.close(linger=0)


class StageLinks:
    """Invariant: `inbox` (at `address`) receives every stage's replies and the last stage's logits;
    handles made here have distinct idents."""

    def __init__(self, stage_addresses: tuple[str, ...]):
        self.context = zmq.Context()
        self.inbox = self.context.socket(zmq.PULL)
        host = head_host(stage_addresses)
        self.address = f"tcp://{host}:{self.inbox.bind_to_random_port(f'tcp://{host}')}"
        self.idents = itertools.count(1)

    def handle(self, address: str | None = None) -> StageHandle:
        """A link to the stage server at `address`, or to a new local stage process."""
        return StageHandle(self.context, next(self.idents), address)

    def probe(self, handles: list[StageHandle], config: EngineConfig, timeout_s: float) -> list[NodeProfile]:
        """Each server's profile, measured there for `config`. Raises ReplicaFailedError naming the
        servers that did not answer within timeout_s."""
        for handle in handles:
            send(handle.control, Probe(handle.ident, dataclasses.asdict(config), self.address))
        profiles: dict[int, NodeProfile] = {}
        deadline = time.monotonic() + timeout_s
        while len(profiles) < len(handles) and time.monotonic() < deadline:
            if self.inbox.poll(100):
                message, _ = receive(self.inbox)
                if isinstance(message, Profiled):
                    profiles[message.ident] = message.profile
        silent = [handle.inbox for handle in handles if handle.ident not in profiles]
        if silent:
            raise ReplicaFailedError(f"pipeline: stage servers {silent} did not answer a probe "
                                     f"within {timeout_s:.0f} s")
        return [profiles[handle.ident] for handle in handles]

    def close(self) -> None:
        self.context.destroy(linger=0)
