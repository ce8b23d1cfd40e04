"""The head's links to its pipeline stages: its inbox, bound where every stage can reach it, and a
handle per stage server (a local process it started, or a `shoal stage` at an address).

Every link is ZeroMQ CURVE with the cluster secret (see cluster_sockets). Stage servers at given
addresses need the configured secret, the same as theirs; with local stage processes only, a head
without one draws a secret for the run and hands it to them in their environment."""

from __future__ import annotations

import ipaddress
import itertools
import logging
import socket
import subprocess
import sys
import time

import torch
import zmq

from shoal.config.engine import EngineConfig
from shoal.errors import ReplicaFailedError
from shoal.parallel.cluster_sockets import ClusterContext
from shoal.parallel.stage_messages import receive, send
from shoal.processes import die_with_parent, free_port
from shoal.protocol.cluster_secret import child_environment, required_secret, run_secret
from shoal.protocol.frames import BadFrame
from shoal.protocol.stage_frames import HEAD_INBOX, NodeProfile, Probe, Profiled

log = logging.getLogger(__name__)


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

    def __init__(self, links: ClusterContext, secret: str, ident: int, address: str | None = None):
        """A new local stage process (address None) gets `secret` as its cluster secret."""
        self.ident = ident
        self.stage: int | None = None
        self.process = None
        if address is None:
            address = f"tcp://127.0.0.1:{free_port()}"
            self.process = subprocess.Popen(
                [sys.executable, "-m", "shoal.parallel.pipeline_stage", "--bind", address],
                env=child_environment(secret),
                preexec_fn=die_with_parent,
            )
        self.inbox = address
        self.control = links.connect(zmq.PUSH, address)
        self.control.setsockopt(zmq.LINGER, 0)

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
        self.secret = required_secret("a pipeline with stage servers") if stage_addresses else run_secret()
        self.context = ClusterContext(self.secret)
        self.inbox, self.address = self.context.bind_to_random_port(zmq.PULL, head_host(stage_addresses))
        self.idents = itertools.count(1)

    def handle(self, address: str | None = None) -> StageHandle:
        """A link to the stage server at `address`, or to a new local stage process."""
        return StageHandle(self.context, self.secret, next(self.idents), address)

    def receive(self) -> tuple[object, torch.Tensor | None] | None:
        """The next message in the inbox and its tensor; None, with a warning, for an invalid one."""
        try:
            return receive(self.inbox, HEAD_INBOX)
        except BadFrame as error:
            log.warning("pipeline head dropped a message: %s", error)
            return None

    def probe(self, handles: list[StageHandle], config: EngineConfig, timeout_s: float) -> list[NodeProfile]:
        """Each server's profile, measured there for `config`. Raises ReplicaFailedError naming the
        servers that did not answer within timeout_s."""
        for handle in handles:
            send(handle.control, Probe(handle.ident, config.to_json(), self.address))
        profiles: dict[int, NodeProfile] = {}
        deadline = time.monotonic() + timeout_s
        while len(profiles) < len(handles) and time.monotonic() < deadline:
            if self.inbox.poll(100) and (received := self.receive()) is not None:
                message, _ = received
                if isinstance(message, Profiled):
                    profiles[message.ident] = message.profile
        silent = [handle.inbox for handle in handles if handle.ident not in profiles]
        if silent:
            raise ReplicaFailedError(
                f"pipeline: stage servers {silent} did not answer a probe within {timeout_s:.0f} s"
            )
        return [profiles[handle.ident] for handle in handles]

    def close(self) -> None:
        self.context.close()
