"""ZeroMQ sockets that speak only to holders of the cluster secret: ZeroMQ CURVE, with one key pair
derived from the secret that every process of the cluster holds.

Why CURVE rather than an HMAC over every message: its handshake mixes fresh ephemeral keys from
both ends, so frames captured on the wire cannot be replayed, into the same connection or a new
one, without keeping a counter per sender (which a restarted receiver would lose); a peer that
cannot prove the key never completes a connection, so it cannot send a single frame, nor drain a
PUSH socket's messages by connecting to it; and the traffic is encrypted, which matters because
step batches carry the users' prompt tokens and activations across machines. libzmq does all of
it, in C, before a frame reaches Python.

A bound socket is a CURVE server: its context runs a ZAP handler that admits only clients whose
public key is the cluster's (a client must hold the derived secret key to prove it), and a monitor
that logs each refused handshake at warning (at most one line a second per socket, with a count
of those not logged). A connected socket is a CURVE client with the cluster's key pair.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

import zmq
import zmq.auth.thread
from zmq.utils import z85
from zmq.utils.monitor import recv_monitor_message

from shoal.protocol.cluster_secret import derived_key

log = logging.getLogger(__name__)

REFUSALS = {
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "the handshake failed",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "not a CURVE peer holding the cluster secret",
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "its key is not the cluster's",
}
REFUSED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
REFUSAL_LOG_INTERVAL_S = 1.0


@dataclass(frozen=True)
class ClusterKeys:
    """The CURVE key pair (Z85 text) every process derives from the cluster secret."""

    public: bytes
    secret: bytes

    @classmethod
    def from_secret(cls, secret: str) -> ClusterKeys:
        secret_key = z85.encode(derived_key(secret, "zmq-curve"))
        return cls(zmq.curve_public(secret_key), secret_key)


class _ClusterKeyOnly:
    """ZAP credentials check: the client's CURVE public key must be the cluster's."""

    def __init__(self, public: bytes):
        self.public = public

    def callback(self, domain: str, key: bytes) -> bool:
        return key == self.public


class ClusterContext:
    """A ZeroMQ context for links between cluster processes. Invariant: every socket made here is a
    CURVE server or client with the cluster's keys; a bound one is monitored until it closes."""

    def __init__(self, secret: str):
        self.keys = ClusterKeys.from_secret(secret)
        self.context = zmq.Context()
        self._authenticator: zmq.auth.thread.ThreadAuthenticator | None = None
        self._bound: list[zmq.Socket] = []
        self._monitors: list[threading.Thread] = []

    def connect(self, kind: int, address: str) -> zmq.Socket:
        sock = self.context.socket(kind)
        sock.curve_serverkey = self.keys.public
        sock.curve_publickey = self.keys.public
        sock.curve_secretkey = self.keys.secret
        sock.connect(address)
        return sock

    def bind(self, kind: int, address: str) -> zmq.Socket:
        sock = self._server(kind)
        sock.bind(address)
        self._monitor(sock, address)
        return sock

    def bind_to_random_port(self, kind: int, host: str) -> tuple[zmq.Socket, str]:
        """A socket bound to a free port of `host`, and its address."""
        sock = self._server(kind)
        address = f"tcp://{host}:{sock.bind_to_random_port(f'tcp://{host}')}"
        self._monitor(sock, address)
        return sock, address

    def _server(self, kind: int) -> zmq.Socket:
        if self._authenticator is None:
            self._authenticator = zmq.auth.thread.ThreadAuthenticator(self.context)
            self._authenticator.start()
            self._authenticator.configure_curve_callback("*", _ClusterKeyOnly(self.keys.public))
        sock = self.context.socket(kind)
        sock.curve_server = True
        sock.curve_publickey = self.keys.public
        sock.curve_secretkey = self.keys.secret
        return sock

    def _monitor(self, sock: zmq.Socket, address: str) -> None:
        self._bound.append(sock)
        events = sock.get_monitor_socket(REFUSED_EVENTS | zmq.EVENT_MONITOR_STOPPED)
        thread = threading.Thread(target=_log_refusals, args=(events, address), name=f"refusals {address}", daemon=True)
        thread.start()
        self._monitors.append(thread)

    def close(self) -> None:
        """Closes every socket made here (a bound socket's monitor ends with it)."""
        for sock in self._bound:
            sock.close(linger=0)
        for thread in self._monitors:
            thread.join(timeout=5)
        if self._authenticator is not None:
            self._authenticator.stop()
        self.context.destroy(linger=0)


def _log_refusals(events: zmq.Socket, address: str) -> None:
    last_logged, unlogged = 0.0, 0
    try:
        while (event := recv_monitor_message(events))["event"] != zmq.EVENT_MONITOR_STOPPED:
            if time.monotonic() - last_logged < REFUSAL_LOG_INTERVAL_S:
                unlogged += 1
                continue
            more = f" ({unlogged} more refused since the last line)" if unlogged else ""
            log.warning("refused a connection to %s: %s%s", address, REFUSALS.get(event["event"], "refused"), more)
            last_logged, unlogged = time.monotonic(), 0
    except zmq.ZMQError:  # the context was destroyed first
        pass
    finally:
        events.close(linger=0)
