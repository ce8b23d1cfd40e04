"""A worker's KV peer: the workers of a cluster fetch KV blocks from each other over ZeroMQ.

The peer binds a ROUTER on the worker's host, a CURVE server for holders of the cluster secret
only (shoal.parallel.cluster_sockets), and answers each KVWanted with the KV of the longest prefix
of its tokens that the worker's cache holds (shoal.protocol.kv_frames; possibly no block), exported
by the engine thread between steps, or with a KVRefused saying why not. A bad request never stops
it. `fetch_kv` asks a peer, from a thread of its own.

The peer binds on the worker's host and is known by `address`, with the host the worker advertises
(a worker bound to every interface is reached at the one it names). `on_request` runs, on the
peer's thread, for every request it takes (a draining worker stays up while peers still fetch);
`on_exported` for every export sent, with the blocks and the seconds from request to answer.

A requester that shares this host's /dev/shm (the same HOST_KEY) gets the tensors in a
shared-memory segment rather than through the socket; it unlinks the segment once read, and the
peer unlinks any its requester never claimed (gone, or timed out) after SEGMENT_CLAIM_S.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing import shared_memory
from pathlib import Path

import zmq

from shoal.engine.async_engine import AsyncLLMEngine
from shoal.engine.kv_transfer import KVBlocks, from_frames, to_frames, to_shared_frames
from shoal.parallel.cluster_sockets import ClusterContext
from shoal.protocol import kv_frames
from shoal.protocol.frames import BadFrame

log = logging.getLogger(__name__)

EXPORT_TIMEOUT_S = 30.0
SEGMENT_CLAIM_S = 60.0


def _host_key() -> str:
    """Equal for processes that share a /dev/shm: the same boot of a machine, the same mount."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    shm = os.stat("/dev/shm") if os.path.isdir("/dev/shm") else None
    if not boot.exists() or shm is None:
        return ""
    return f"{boot.read_text().strip()}:{shm.st_dev}:{shm.st_ino}"


HOST_KEY = _host_key()  # empty: no shared memory here


class KVPeer:
    """Invariant: every request gets exactly one answer, in the order received."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        context: ClusterContext,
        host: str,
        loop: asyncio.AbstractEventLoop,
        advertise_host: str | None = None,
        on_request: Callable[[], None] = lambda: None,
        on_exported: Callable[[KVBlocks, float], None] = lambda blocks, seconds: None,
    ):
        self.engine, self.loop = engine, loop
        self.on_request, self.on_exported = on_request, on_exported
        self.socket, bound = context.bind_to_random_port(zmq.ROUTER, host)
        port = bound.rsplit(":", 1)[1]
        self.address = f"tcp://{advertise_host}:{port}" if advertise_host else bound
        self._segments: deque[tuple[float, str]] = deque()  # (created, name), oldest first
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="shoal-kv-peer", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stopped.is_set():
            self._unlink_unclaimed(time.monotonic() - SEGMENT_CLAIM_S)
            if not self.socket.poll(100):
                continue
            identity, *message = self.socket.recv_multipart(copy=False)
            self.on_request()
            started = time.monotonic()
            answer, exported = self._answer([frame.buffer for frame in message])
            self.socket.send_multipart([identity, *answer], copy=False)
            if exported is not None:
                self.on_exported(exported, time.monotonic() - started)

    def _answer(self, message: list[memoryview]) -> tuple[list[bytes | memoryview], KVBlocks | None]:
        """The answer's frames, and the blocks it carries (None for a refusal)."""
        try:
            wanted = kv_frames.decode_request(message)
            exporting = asyncio.run_coroutine_threadsafe(self.engine.export_kv(wanted.token_ids), self.loop)
            exported = exporting.result(EXPORT_TIMEOUT_S)
            if not (HOST_KEY and wanted.host == HOST_KEY):
                return to_frames(exported), exported
            frames, segment = to_shared_frames(exported)
            if segment:
                self._segments.append((time.monotonic(), segment))
            return frames, exported
        except BadFrame as exc:
            log.warning("KV peer: refused a request: %s", exc)
            return [kv_frames.encode(kv_frames.KVRefused(f"bad request: {exc}"))], None
        except Exception as exc:  # the engine could not export (a parallel replica, shutting down)
            return [kv_frames.encode(kv_frames.KVRefused(f"{type(exc).__name__}: {exc}"))], None

    def _unlink_unclaimed(self, created_before: float) -> None:
        while self._segments and self._segments[0][0] < created_before:
            _, name = self._segments.popleft()
            try:
                segment = shared_memory.SharedMemory(name)
            except FileNotFoundError:
                continue  # claimed
            segment.close()
            segment.unlink()
            log.warning("KV peer: unlinked shared-memory segment %s, never claimed", name)

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        self.socket.close(linger=0)
        self._unlink_unclaimed(float("inf"))


def fetch_kv(
    context: ClusterContext, address: str, token_ids: list[int], timeout_s: float, shared_memory: bool = True
) -> KVBlocks:
    """The KV of the longest prefix of `token_ids` the peer at `address` holds. Blocks; TimeoutError
    when no answer comes within timeout_s (a peer that is gone, or one that does not hold the
    cluster secret: the handshake never completes), KVRefusedError for its refusal, BadFrame for
    an answer that is not what it says. With `shared_memory` a peer on this host may answer
    through a shared-memory segment."""
    socket = context.connect(zmq.DEALER, address)
    try:
        host = HOST_KEY if shared_memory and HOST_KEY else None
        socket.send(kv_frames.encode(kv_frames.KVWanted(list(token_ids), host=host)))
        if not socket.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no KV from {address} within {timeout_s:g} s")
        return from_frames(socket.recv_multipart())
    finally:
        socket.close(linger=0)
