"""Forwards one request to a worker and relays its answer, streamed or not, byte for byte.

The body is sent as the client wrote it (no re-encoding) and server-sent events are passed through
as they arrive. The upstream client is aiohttp: under 64 concurrent requests it relayed several
times more requests per second on one core than httpx did (benchmarks/router_overhead.py). The placement's in-flight entry moves from prefill to decode at the first byte and
is released when the response ends, whether it completed, failed or the client went away.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Mapping

import aiohttp
from starlette.responses import Response, StreamingResponse

from shoal.router.balancer import Placement

FORWARDED_HEADERS = ("content-type", "traceparent", "tracestate", "x-request-id")


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})
    return Response(body, status_code=status, media_type="application/json", headers=headers)


async def forward(session: aiohttp.ClientSession, placement: Placement, path: str, body: bytes,
                  headers: Mapping[str, str], release: Callable[[Placement], None],
                  extra_headers: dict[str, str] | None = None) -> Response:
    """Returns the worker's response (with `extra_headers` and x-shoal-worker added); 502 if the
    worker cannot be reached or fails mid-way."""
    worker = placement.worker
    outgoing = {k: headers[k] for k in FORWARDED_HEADERS if k in headers}
    try:
        upstream = await session.post(worker.url + path, data=body, headers=outgoing)
    except (aiohttp.ClientError, TimeoutError) as exc:
        release(placement)
        return error_response(502, f"worker {worker.worker_id} failed: {type(exc).__name__}", "upstream_error")
    worker.first_byte(placement.ticket)
    reply_headers = {"x-shoal-worker": worker.worker_id, **(extra_headers or {})}
    content_type = upstream.headers.get("content-type", "")
    if content_type.startswith("text/event-stream"):
        return StreamingResponse(_relay(upstream, placement, release), status_code=upstream.status,
                                 media_type="text/event-stream", headers=reply_headers)
    try:
        content = await upstream.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        return error_response(502, f"worker {worker.worker_id} failed mid-response: {type(exc).__name__}",
                              "upstream_error")
    finally:
        upstream.release()
        release(placement)
    if "retry-after" in upstream.headers:
        reply_headers["retry-after"] = upstream.headers["retry-after"]
    return Response(content, status_code=upstream.status, headers=reply_headers, media_type=content_type or None)


async def _relay(upstream: aiohttp.ClientResponse, placement: Placement,
                 release: Callable[[Placement], None]) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.content.iter_any():
            yield chunk
    finally:
        upstream.release()
        release(placement)
