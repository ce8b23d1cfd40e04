"""The relay reads a worker's events one by one and writes those that arrived together to the client
as one chunk, against a real HTTP server on loopback: a chunk never waits for events still to come,
and whatever the relay counts as sent has been yielded before the stream breaks or moves."""

from __future__ import annotations

import asyncio
import json
import time

import pytest
from prometheus_client import CollectorRegistry

from shoal.observability.tracing import Tracing
from shoal.protocol.sse import data_values, is_done
from shoal.router.config import FailoverSettings
from shoal.router.fleet.circuit_breaker import CircuitBreaker
from shoal.router.fleet.worker_state import WorkerState
from shoal.router.metrics import RouterMetrics
from shoal.router.request_telemetry import RequestTelemetry
from shoal.router.streams.relay import StreamBroken, StreamProgress, relay
from shoal.router.streams.upstream_client import UpstreamClient
from tests.support.scripted_server import ScriptedServer

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def token(text: str, token_id: int, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": {"content": text}, "token_ids": [token_id], "finish_reason": finish}
    return b"data: " + json.dumps({"id": "c1", "choices": [choice]}).encode() + b"\n\n"


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


Timed = list[tuple[float, bytes]]


async def relayed(writes: Timed) -> tuple[Timed, StreamProgress, Exception | None]:
    """The chunks relay() yields (with the seconds since the request when each came) for a worker
    that sends each write after its pause, the progress it kept, and what it raised."""

    async def answer(request, writer):
        writer.write(HEAD)
        for pause, data in writes:
            await asyncio.sleep(pause)
            writer.write(data)
            await writer.drain()
        return "close"

    worker = WorkerState("w", "http://w", frozenset({"m"}), CircuitBreaker(5, 5.0, 60.0, lambda *_: None))
    telemetry = RequestTelemetry(Tracing("test"), RouterMetrics(CollectorRegistry()), {}, "/v1/chat/completions")
    progress, got, raised = StreamProgress(), [], None
    async with ScriptedServer(answer) as url:
        upstream = await UpstreamClient(2, 5).post(url + "/v1/chat/completions", b"{}", {})
        started = time.monotonic()
        try:
            async for out in relay(upstream, worker, progress, telemetry, FailoverSettings(), ticket=0):
                got.append((time.monotonic() - started, out))
        except StreamBroken as exc:
            raised = exc
    return got, progress, raised


def tokens_in(chunks: Timed) -> list[int]:
    return [
        token_id
        for _, out in chunks
        for data in data_values(out)
        if not is_done(data)
        for token_id in json.loads(data)["choices"][0]["token_ids"]
    ]


def test_events_that_arrive_together_go_out_as_one_chunk():
    burst = token("a", 1) + token("b", 2) + token("c", 3, "stop") + b"data: [DONE]\n\n"
    got, progress, raised = asyncio.run(relayed([(0, chunk(burst) + chunk(b""))]))
    assert raised is None and len(got) == 1
    assert got[0][1] == burst  # the same bytes, in one write
    assert tokens_in(got) == progress.token_ids == [1, 2, 3] and progress.finished


def test_an_event_is_not_held_back_for_the_next_one():
    got, progress, raised = asyncio.run(
        relayed([(0, chunk(token("a", 1))), (0.5, chunk(token("b", 2, "stop") + b"data: [DONE]\n\n") + chunk(b""))])
    )
    assert raised is None and len(got) == 2
    assert got[0][0] < 0.4  # the first token went out before the second arrived
    assert tokens_in(got) == [1, 2]


@pytest.mark.parametrize(
    "ending",
    [
        b'data: {"error": {"message": "engine died", "code": 500}}\n\n',  # the worker fails the request
        b"",  # the connection ends without [DONE]
    ],
)
def test_what_the_relay_counts_as_sent_was_yielded_before_the_stream_breaks(ending):
    got, progress, raised = asyncio.run(relayed([(0, chunk(token("a", 1) + token("b", 2) + ending))]))
    assert isinstance(raised, StreamBroken)
    assert tokens_in(got) == progress.token_ids == [1, 2]  # a continuation resumes after exactly these
