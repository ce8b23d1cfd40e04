"""A worker's KV peer: the workers of a cluster fetch KV blocks from each other over ZeroMQ.

The peer binds a ROUTER on the worker's host, a CURVE server for holders of the cluster secret
only (shoal.parallel.cluster_sockets), and answers each KVWanted with the KV of the longest prefix
of its tokens that the worker's cache holds (shoal.protocol.kv_frames; possibly no block), exported
by the engine thread between steps, or with a KVRefused saying why not. A bad request never stops
it. `fetch_kv` asks a peer, from a thread of its own.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import zmq

from shoal.engine.async_engine import AsyncLLMEngine
from shoal.engine.kv_transfer import KVBlocks, from_frames, to_frames
from shoal.parallel.cluster_sockets import ClusterContext
from shoal.protocol import kv_frames
from shoal.protocol.frames import BadFrame

log = logging.getLogger(__name__)

EXPORT_TIMEOUT_S = 30.0


class KVPeer:
    """Invariant: every request gets exactly one answer, in the order received."""

    def __init__(self, engine: AsyncLLMEngine, context: ClusterContext, host: str, loop: asyncio.AbstractEventLoop):
        self.engine, self.loop = engine, loop
        self.socket, self.address = context.bind_to_random_port(zmq.ROUTER, host)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="shoal-kv-peer", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            if not self.socket.poll(100):
                continue
            identity, *message = self.socket.recv_multipart(copy=False)
            self.socket.send_multipart([identity, *self._answer([frame.buffer for frame in message])], copy=False)

    def _answer(self, message: list[memoryview]) -> list[bytes | memoryview]:
        try:
            wanted = kv_frames.decode_request(message)
            exported = asyncio.run_coroutine_threadsafe(self.engine.export_kv(wanted.token_ids), self.loop)
            return to_frames(exported.result(EXPORT_TIMEOUT_S))
        except BadFrame as exc:
            log.warning("KV peer: refused a request: %s", exc)
            return [kv_frames.encode(kv_frames.KVRefused(f"bad request: {exc}"))]
        except Exception as exc:  # the engine could not export (a parallel replica, shutting down)
            return [kv_frames.encode(kv_frames.KVRefused(f"{type(exc).__name__}: {exc}"))]

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        self.socket.close(linger=0)


def fetch_kv(context: ClusterContext, address: str, token_ids: list[int], timeout_s: float) -> KVBlocks:
    """The KV of the longest prefix of `token_ids` the peer at `address` holds. Blocks; TimeoutError
    when no answer comes within timeout_s (a peer that is gone, or one that does not hold the
    cluster secret: the handshake never completes), KVRefusedError for its refusal, BadFrame for
    an answer that is not what it says."""
    socket = context.connect(zmq.DEALER, address)
    try:
        socket.send(kv_frames.encode(kv_frames.KVWanted(list(token_ids))))
        if not socket.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no KV from {address} within {timeout_s:g} s")
        return from_frames(socket.recv_multipart())
    finally:
        socket.close(linger=0)
