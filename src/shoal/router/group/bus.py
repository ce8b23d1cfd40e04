"""The local channel between the processes of one router group (shoal.router.router_group).

Each member listens on a unix socket in the group's private directory (mode 0700) and keeps a
connection open to every other member's. A connection starts with a Hello carrying the group's token (a
random secret the group's parent gave its members; compared in constant time; a stranger is cut
off before anything else is read), then carries length-prefixed msgpack batches of the typed
events of shoal.protocol.group_events. What a member publishes in one turn of its event loop
goes out as one batch, so the cost of telling N-1 members does not grow with the request rate.

Events for a member that is not connected (starting, restarting) are dropped; what must survive
that is sent again whole when the connection (re)opens (`snapshot`). A member that stops reading
is cut off once MAX_BUFFERED_BYTES wait for it, and sent a snapshot when it comes back.
Invariant: every event a member receives was sent by a member of its group; when a member's
connection closes (or a new one from it opens), `gone(member)` runs before anything it sends on
the new one is applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import struct
from collections.abc import Callable
from pathlib import Path

import msgspec

from shoal.protocol.group_events import BATCH_DECODER, ENCODER, HELLO_DECODER, MAX_FRAME_BYTES, Event, Hello

log = logging.getLogger(__name__)
LENGTH = struct.Struct(">I")
MAX_BUFFERED_BYTES = 8 << 20
RECONNECT_S = 0.2


def socket_path(directory: Path, member: int) -> Path:
    return directory / f"member-{member}.sock"


class GroupBus:
    def __init__(
        self,
        directory: Path,
        member: int,
        members: int,
        token: bytes,
        apply: Callable[[int, list[Event]], None],
        gone: Callable[[int], None],
        snapshot: Callable[[], list[Event]],
    ):
        self.directory, self.member, self.members, self.token = directory, member, members, token
        self.apply, self.gone, self.snapshot = apply, gone, snapshot
        self._outbox: list[Event] = []
        self._flush_scheduled = False
        self._writers: dict[int, asyncio.StreamWriter] = {}  # to each member
        self._readers: dict[int, asyncio.StreamWriter] = {}  # the current connection from each
        self._tasks: list[asyncio.Task] = []
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        path = socket_path(self.directory, self.member)
        path.unlink(missing_ok=True)
        self._server = await asyncio.start_unix_server(self._receive, path=str(path), limit=MAX_FRAME_BYTES)
        path.chmod(0o600)
        for member in range(self.members):
            if member != self.member:
                self._tasks.append(asyncio.create_task(self._keep_connected(member)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for writer in self._writers.values():
            writer.close()
        if self._server is not None:
            self._server.close()

    def publish(self, event: Event) -> None:
        """Sends `event` to every connected member, batched with the rest of this loop turn's."""
        if not self._writers:
            return
        self._outbox.append(event)
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self._outbox:
            return
        frame = _frame(ENCODER.encode(self._outbox))
        self._outbox = []
        for member, writer in list(self._writers.items()):
            if writer.transport.get_write_buffer_size() > MAX_BUFFERED_BYTES:
                log.warning("router member %d is not reading; cutting it off until it reconnects", member)
                writer.close()
                continue
            writer.write(frame)

    async def _keep_connected(self, member: int) -> None:
        """Holds this member's connection to `member`, opening it again whenever it closes."""
        path = str(socket_path(self.directory, member))
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(path)
            except OSError:
                await asyncio.sleep(RECONNECT_S)
                continue
            writer.write(_frame(ENCODER.encode(Hello(member=self.member, token=self.token))))
            writer.write(_frame(ENCODER.encode(self.snapshot())))
            self._writers[member] = writer
            with contextlib.suppress(ConnectionError):
                await reader.read()  # the member never sends on this connection: this waits for its end
            self._writers.pop(member, None)
            writer.close()
            await asyncio.sleep(RECONNECT_S)

    async def _receive(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        member = None
        try:
            hello = HELLO_DECODER.decode(await _read_frame(reader))
            if not hmac.compare_digest(hello.token, self.token) or not 0 <= hello.member < self.members:
                log.warning("refused a connection to the router group's channel: wrong token or member")
                return
            member = hello.member
            if member in self._readers:  # a restarted member: what its last run said is void
                self.gone(member)
            self._readers[member] = writer
            while True:
                self.apply(member, BATCH_DECODER.decode(await _read_frame(reader)))
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        except (msgspec.DecodeError, ValueError) as exc:
            log.warning("dropped router member %s's connection: %s", member, exc)
        finally:
            writer.close()
            if member is not None and self._readers.get(member) is writer:
                del self._readers[member]
                self.gone(member)


def _frame(payload: bytes) -> bytes:
    return LENGTH.pack(len(payload)) + payload


async def _read_frame(reader: asyncio.StreamReader) -> bytes:
    (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
    if length > MAX_FRAME_BYTES:
        raise ValueError(f"a frame of {length} bytes is over the limit")
    return await reader.readexactly(length)
