"""HTTP/1.1 from the router to its workers: keep-alive connections over asyncio, responses parsed
by httptools (llhttp, the parser uvicorn uses).

Relaying is the router's hot path. Behind one uvicorn process, a relay through aiohttp's client
topped out near 8,000 requests/s on one core, one through this client near 24,000: aiohttp spends
about 80 µs of Python on each request, this client about 15 (benchmarks/router_overhead.py). It
does only what the router needs: POST a body, read the response whole or line by line as it
streams, connect and read timeouts, and connections kept per worker and reused.

Invariants: a connection carries one request at a time, and goes back to its pool only after its
response was read to the end with keep-alive; any other release closes it. A request on a reused
connection that the worker closed before answering anything (its keep-alive ran out as the
request left) is sent once more on a new connection.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Iterable, Mapping
from urllib.parse import urlsplit

import httptools

# Idle connections older than this are not reused: workers (uvicorn) close theirs after 5 s.
IDLE_REUSE_S = 4.0
MAX_TARGETS = 4096
# A response buffering more than this unread pauses reading from its socket until it is drained.
HIGH_WATER_BYTES = 1 << 20


class UpstreamError(Exception):
    """Base of the client's errors; `connection_lost` tells the worker's process or link may be gone
    (a restarted worker may take the request again) from a worker that answered wrongly."""

    connection_lost = True


class Unreachable(UpstreamError):
    """The connection could not be made (refused, no route)."""


class Disconnected(UpstreamError):
    """The worker closed the connection before the response ended."""


class ClosedHere(UpstreamError):
    """The router closed the response (a severed stream) while it was being read."""


class MalformedResponse(UpstreamError):
    """The worker sent something that is not HTTP/1.1."""

    connection_lost = False


class UpstreamResponse:
    """One response: `status` and `headers` (lower-case names) once returned by post(); the body
    from read() or readline(). release() when done with it."""

    def __init__(self, connection: _Connection, read_timeout_s: float):
        self.connection = connection
        self.read_timeout_s = read_timeout_s
        self.status = 0
        self.headers: dict[str, str] = {}
        self.headers_done = False
        self.complete = False
        self.error: UpstreamError | None = None
        self._buffer = bytearray()
        self._waiter: asyncio.Future | None = None

    async def read(self) -> bytes:
        """The rest of the body."""
        while not self.complete:
            await self._wait()
        data = bytes(self._buffer)
        self._buffer.clear()
        return data

    async def readline(self, timeout_s: float | None = None) -> bytes:
        """The next line with its newline; what is left without one at the end; b'' after it.
        TimeoutError when no whole line came within `timeout_s` (else data within the read timeout)."""
        ends = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            end = self._buffer.find(b"\n")
            if end >= 0 or self.complete:
                end = end + 1 if end >= 0 else len(self._buffer)
                line = bytes(self._buffer[:end])
                del self._buffer[:end]
                self.connection.drained(len(self._buffer))
                return line
            await self._wait(None if ends is None else max(ends - time.monotonic(), 0.0))

    def line_ready(self) -> bool:
        """Whether readline() would return without waiting (a whole line, or the end, is here)."""
        return self.complete or self.error is not None or self._buffer.find(b"\n") >= 0

    def release(self) -> None:
        """Done with the response: its connection goes back to the pool if the response was read to
        the end and may be kept alive, else it is closed."""
        self.connection.finished(self)

    def close(self) -> None:
        """Closes the connection now; a reader waiting on it gets ClosedHere."""
        self._fail(ClosedHere("closed by the router"))
        self.connection.close()

    async def _wait(self, timeout_s: float | None = None) -> None:
        """Until the parser moves on (headers, body bytes, the end) or the connection fails, at
        most `timeout_s` (else the read timeout) without data."""
        if self.error is not None:
            raise self.error
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        self.connection.watch(loop, loop.time() + (self.read_timeout_s if timeout_s is None else timeout_s))
        try:
            await waiter
        finally:
            self._waiter = None
        if self.error is not None:
            raise self.error

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _timed_out(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(TimeoutError("the worker sent nothing in time"))

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None and not self.complete:
            self.error = error
            self._wake()

    # httptools' callbacks, through the connection
    def _header(self, name: bytes, value: bytes) -> None:
        self.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def _headers_complete(self, status: int) -> None:
        self.status, self.headers_done = status, True
        self._wake()

    def _body(self, data: bytes) -> None:
        self._buffer += data
        self.connection.buffered(len(self._buffer))
        self._wake()

    def _message_complete(self) -> None:
        self.complete = True
        self._wake()


class _Connection(asyncio.Protocol):
    """One TCP connection to a worker and its response parser. The wait of its response in progress
    ends by `deadline` (loop time) at the latest: one timer per connection, armed for the earliest
    deadline it has been given and moved on, when it fires, to the latest one (a wait does not pay
    for a timer of its own: a stream waits once per token)."""

    def __init__(self, pool: _AddressPool):
        self.pool = pool
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.closed = False
        self.received_any = False  # for the response in progress
        self.idle_since = 0.0
        self.paused = False
        self.keep_alive = False  # as the response in progress says (read when its headers end)
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None

    def watch(self, loop: asyncio.AbstractEventLoop, deadline: float) -> None:
        """The response in progress waits until `deadline` at most."""
        self.deadline = deadline
        if self.timer is not None and self.timer.when() > deadline:
            self.timer.cancel()
            self.timer = None
        if self.timer is None and not self.closed:
            self.timer = loop.call_at(deadline, self._deadline_reached, loop)

    def _deadline_reached(self, loop: asyncio.AbstractEventLoop) -> None:
        self.timer = None
        if self.response is None or self.closed:
            return  # nothing waits: the next wait arms the timer again
        if loop.time() < self.deadline:
            self.timer = loop.call_at(self.deadline, self._deadline_reached, loop)
        else:
            self.response._timed_out()

    def send(self, response: UpstreamResponse, request: bytes) -> None:
        self.response, self.received_any = response, False
        self.transport.write(request)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.received_any = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            if self.response is not None:
                self.response._fail(MalformedResponse(f"the worker's response is not HTTP/1.1: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        if self.response is not None:
            self.response._fail(Disconnected("the worker closed the connection"))

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._stop_timer()
            self.transport.close()

    def _stop_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def buffered(self, size: int) -> None:
        if size > HIGH_WATER_BYTES and not self.paused and not self.closed:
            self.paused = True
            self.transport.pause_reading()

    def drained(self, size: int) -> None:
        if self.paused and size < HIGH_WATER_BYTES // 2 and not self.closed:
            self.paused = False
            self.transport.resume_reading()

    def finished(self, response: UpstreamResponse) -> None:
        if self.response is not response:
            return
        self.response = None
        if response.complete and self.keep_alive and not self.closed and not self.paused:
            self.idle_since = time.monotonic()
            self.pool.idle.append(self)
        else:
            self.close()

    # httptools' callbacks
    def on_header(self, name: bytes, value: bytes) -> None:
        if self.response is not None:
            self.response._header(name, value)

    def on_headers_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        if self.response is not None:
            self.response._headers_complete(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._body(body)

    def on_message_complete(self) -> None:
        if self.response is not None:
            self.response._message_complete()


class _AddressPool:
    """The connections to one host:port; `idle` most recently used last."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.host_header = f"Host: {host}:{port}\r\n".encode()
        self.idle: deque[_Connection] = deque()

    def take_idle(self) -> _Connection | None:
        now = time.monotonic()
        while self.idle:
            connection = self.idle.pop()
            if not connection.closed and now - connection.idle_since < IDLE_REUSE_S:
                return connection
            connection.close()
        return None

    def close(self) -> None:
        while self.idle:
            self.idle.pop().close()


class UpstreamClient:
    """Keep-alive connections to any number of workers (http:// URLs)."""

    def __init__(self, connect_timeout_s: float, read_timeout_s: float):
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self._pools: dict[tuple[str, int], _AddressPool] = {}
        self._targets: dict[str, tuple[_AddressPool, bytes]] = {}

    async def post(
        self,
        url: str,
        body: bytes,
        headers: Mapping[str, str],
        track: set[UpstreamResponse] | None = None,
    ) -> UpstreamResponse:
        """Sends the request; returns once the response's status and headers are in. While it is
        open the response is in `track` (the caller removes it), so closing it there cuts the wait
        short (ClosedHere). Raises UpstreamError or TimeoutError."""
        pool, path = self._target(url)
        request = _request_bytes(path, pool.host_header, headers.items(), body)
        connection = pool.take_idle()
        reused = connection is not None
        while True:
            if connection is None:
                connection = await self._connect(pool)
            response = UpstreamResponse(connection, self.read_timeout_s)
            if track is not None:
                track.add(response)
            connection.send(response, request)
            try:
                while not response.headers_done:
                    await response._wait()
                return response
            except Disconnected:
                if track is not None:
                    track.discard(response)
                if not (reused and not connection.received_any):
                    raise
                connection, reused = None, False  # a stale keep-alive connection: once more, anew
            except BaseException:
                if track is not None:
                    track.discard(response)
                response.close()
                raise

    async def close(self) -> None:
        for pool in self._pools.values():
            pool.close()

    def _target(self, url: str) -> tuple[_AddressPool, bytes]:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) >= MAX_TARGETS:  # workers come and go: forget the URLs of the past
                self._targets.clear()
            parts = urlsplit(url)
            if parts.scheme != "http" or not parts.hostname:
                raise ValueError(f"not an http:// URL: {url!r}")
            address = (parts.hostname, parts.port or 80)
            pool = self._pools.get(address) or self._pools.setdefault(address, _AddressPool(*address))
            path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
            target = self._targets[url] = (pool, path.encode())
        return target

    async def _connect(self, pool: _AddressPool) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            _, connection = await asyncio.wait_for(
                loop.create_connection(lambda: _Connection(pool), pool.host, pool.port), self.connect_timeout_s
            )
        except OSError as exc:
            raise Unreachable(f"cannot connect to {pool.host}:{pool.port}: {exc.strerror or exc}") from None
        return connection


def _request_bytes(path: bytes, host_header: bytes, headers: Iterable[tuple[str, str]], body: bytes) -> bytes:
    lines = "".join([f"{name}: {value}\r\n" for name, value in headers]).encode("latin-1")
    return b"POST %s HTTP/1.1\r\n%s%sContent-Length: %d\r\n\r\n%s" % (path, host_header, lines, len(body), body)
