"""The router's HTTP/1.1 client to its workers, against a real asyncio server on loopback whose
behaviour each test scripts: keep-alive reuse, chunked streams read line by line, the worker
closing connections (idle, mid-body, before answering), timeouts, severing and garbage."""

from __future__ import annotations

import asyncio
import socket

import pytest

from shoal.router.streams.upstream_client import (
    ClosedHere,
    Disconnected,
    MalformedResponse,
    Unreachable,
    UpstreamClient,
)
from tests.support.scripted_server import ScriptedServer, chunked, plain


def test_a_connection_is_kept_alive_and_reused_and_the_request_arrives_whole():
    asyncio.run(_a_connection_is_kept_alive_and_reused_and_the_request_arrives_whole())


async def _a_connection_is_kept_alive_and_reused_and_the_request_arrives_whole():
    async def answer(request, writer):
        writer.write(plain(b'{"ok":true}'))

    server = ScriptedServer(answer)
    async with server as url:
        client = UpstreamClient(connect_timeout_s=2, read_timeout_s=5)
        for _ in range(5):
            response = await client.post(url + "/v1/chat/completions", b'{"a":1}', {"content-type": "application/json"})
            assert response.status == 200
            assert response.headers["content-type"] == "application/json"
            assert await response.read() == b'{"ok":true}'
            response.release()
        await client.close()
    assert server.connections == 1
    first = server.requests[0]
    assert first.startswith(b"POST /v1/chat/completions HTTP/1.1\r\n")
    assert b"\r\ncontent-type: application/json\r\n" in first
    assert first.endswith(b'\r\n\r\n{"a":1}')


def test_a_chunked_stream_is_read_line_by_line_however_it_was_split():
    asyncio.run(_a_chunked_stream_is_read_line_by_line_however_it_was_split())


async def _a_chunked_stream_is_read_line_by_line_however_it_was_split():
    async def answer(request, writer):
        writer.write(chunked(b'data: {"a"', b":1}\n\ndata: [DO", b"NE]\n\n"))

    async with ScriptedServer(answer) as url:
        client = UpstreamClient(2, 5)
        response = await client.post(url + "/x", b"{}", {})
        lines = []
        while line := await response.readline():
            lines.append(line)
        response.release()
    assert lines == [b'data: {"a":1}\n', b"\n", b"data: [DONE]\n", b"\n"]


def test_a_response_that_says_close_is_not_reused():
    asyncio.run(_a_response_that_says_close_is_not_reused())


async def _a_response_that_says_close_is_not_reused():
    async def answer(request, writer):
        writer.write(plain(b"{}", b"Connection: close\r\n"))
        return "close"

    server = ScriptedServer(answer)
    async with server as url:
        client = UpstreamClient(2, 5)
        for _ in range(3):
            response = await client.post(url + "/x", b"{}", {})
            await response.read()
            response.release()
    assert server.connections == 3


def test_a_keep_alive_connection_the_worker_closed_is_replaced_without_an_error():
    asyncio.run(_a_keep_alive_connection_the_worker_closed_is_replaced_without_an_error())


async def _a_keep_alive_connection_the_worker_closed_is_replaced_without_an_error():
    served: set = set()

    async def answer(request, writer):
        if writer in served:  # its keep-alive ran out as the request came: closed, unanswered
            return "close"
        served.add(writer)
        writer.write(plain(b"{}"))

    server = ScriptedServer(answer)
    async with server as url:
        client = UpstreamClient(2, 5)
        for _ in range(3):
            response = await client.post(url + "/x", b"{}", {})
            assert await response.read() == b"{}"
            response.release()
    assert server.connections == 3
    assert len(server.requests) == 5  # the second and third went twice: the first time unanswered


def test_a_worker_that_dies_mid_body_is_a_lost_connection():
    asyncio.run(_a_worker_that_dies_mid_body_is_a_lost_connection())


async def _a_worker_that_dies_mid_body_is_a_lost_connection():
    async def answer(request, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\ndata:\r\n")
        await writer.drain()
        return "close"

    async with ScriptedServer(answer) as url:
        client = UpstreamClient(2, 5)
        response = await client.post(url + "/x", b"{}", {})
        with pytest.raises(Disconnected) as raised:
            await response.readline()  # "data:" came, never its newline
    assert raised.value.connection_lost


def test_a_silent_worker_times_out_the_line_and_the_headers():
    asyncio.run(_a_silent_worker_times_out_the_line_and_the_headers())


async def _a_silent_worker_times_out_the_line_and_the_headers():
    async def answer(request, writer):
        if b"/stream" in request:
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        await asyncio.sleep(10)

    async with ScriptedServer(answer) as url:
        client = UpstreamClient(2, read_timeout_s=0.2)
        with pytest.raises(TimeoutError):
            await client.post(url + "/headers", b"{}", {})
        response = await client.post(url + "/stream", b"{}", {})
        with pytest.raises(TimeoutError):
            await response.readline(timeout_s=0.1)
        response.close()


def test_each_wait_has_its_own_deadline_on_the_connections_one_timer():
    asyncio.run(_each_wait_has_its_own_deadline_on_the_connections_one_timer())


async def _each_wait_has_its_own_deadline_on_the_connections_one_timer():
    """Events 0.1 s apart under a 0.3 s deadline each outlast the first deadline (the timer moves
    on); a 0.3 s wait after the headers' 30 s one ends by its own deadline, not the headers'."""

    async def answer(request, writer):
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for i in range(8):
            await asyncio.sleep(0.1)
            writer.write(b"%x\r\n%s\r\n" % (len(b"data: %d\n" % i), b"data: %d\n" % i))
        await asyncio.sleep(60)

    async with ScriptedServer(answer) as url:
        client = UpstreamClient(2, read_timeout_s=30)
        response = await client.post(url + "/stream", b"{}", {})
        assert [await response.readline(timeout_s=0.3) for _ in range(8)] == [b"data: %d\n" % i for i in range(8)]
        with pytest.raises(TimeoutError, match="the worker sent nothing in time"):
            await asyncio.wait_for(response.readline(timeout_s=0.3), 10)
        response.close()


def test_closing_a_tracked_request_cuts_its_wait_short():
    asyncio.run(_closing_a_tracked_request_cuts_its_wait_short())


async def _closing_a_tracked_request_cuts_its_wait_short():
    async def answer(request, writer):
        await asyncio.sleep(10)

    async with ScriptedServer(answer) as url:
        client = UpstreamClient(2, 30)
        track: set = set()
        posting = asyncio.create_task(client.post(url + "/x", b"{}", {}, track=track))
        while not track:
            await asyncio.sleep(0.01)
        next(iter(track)).close()
        with pytest.raises(ClosedHere):
            await posting
        assert not track


def test_nobody_listening_is_unreachable():
    asyncio.run(_nobody_listening_is_unreachable())


async def _nobody_listening_is_unreachable():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    client = UpstreamClient(2, 5)
    with pytest.raises(Unreachable) as raised:
        await client.post(f"http://127.0.0.1:{port}/x", b"{}", {})
    assert raised.value.connection_lost


def test_garbage_is_a_malformed_response_not_a_lost_connection():
    asyncio.run(_garbage_is_a_malformed_response_not_a_lost_connection())


async def _garbage_is_a_malformed_response_not_a_lost_connection():
    async def answer(request, writer):
        writer.write(b"SMTP ready\r\n\r\n")

    async with ScriptedServer(answer) as url:
        client = UpstreamClient(2, 5)
        with pytest.raises(MalformedResponse) as raised:
            await client.post(url + "/x", b"{}", {})
    assert not raised.value.connection_lost


def test_only_http_urls_are_accepted():
    with pytest.raises(ValueError, match="http://"):
        asyncio.run(UpstreamClient(2, 5).post("https://example.org/x", b"", {}))
