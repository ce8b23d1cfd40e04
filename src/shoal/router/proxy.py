"""Forwards one request to a worker and relays its answer, streamed or not, byte for byte.

The body is sent as the client wrote it (no re-encoding) and server-sent events are passed through
as they arrive. The placement's in-flight entry moves from prefill to decode at the first byte and
is released when the response ends, whether it completed, failed or the client went away.
"""
from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable

import httpx
from starlette.responses import Response, StreamingResponse

from shoal.router.balancer import Placement

FORWARDED_HEADERS = ("content-type", "traceparent", "tracestate", "x-request-id")


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> Response:
    body = json.dumps({"error": {"message": message, "type": kind, "param": param, "code": status}})
    return Response(body, status_code=status, media_type="application/json", headers=headers)


async def forward(client: httpx.AsyncClient, placement: Placement, path: str, body: bytes,
                  headers: dict[str, str], release: Callable[[Placement], None],
                  extra_headers: dict[str, str] | None = None) -> Response:
    """Returns the worker's response (with `extra_headers` and x-shoal-worker added); 502 if the
    worker cannot be reached or fails mid-way."""
    worker = placement.worker
    outgoing = {k: v for k, v in headers.items() if k in FORWARDED_HEADERS}
    request = client.build_request("POST", worker.url + path, content=body, headers=outgoing)
    try:
        upstream = await client.send(request, stream=True)
    except httpx.HTTPError as exc:
        release(placement)
        return error_response(502, f"worker {worker.worker_id} failed: {type(exc).__name__}", "upstream_error")
    worker.first_byte(placement.ticket)
    reply_headers = {"x-shoal-worker": worker.worker_id, **(extra_headers or {})}
    if upstream.headers.get("content-type", "").startswith("text/event-stream"):
        return StreamingResponse(_relay(upstream, placement, release), status_code=upstream.status_code,
                                 media_type="text/event-stream", headers=reply_headers)
    try:
        content = await upstream.aread()
    except httpx.HTTPError as exc:
        return error_response(502, f"worker {worker.worker_id} failed mid-response: {type(exc).__name__}",
                              "upstream_error")
    finally:
        await upstream.aclose()
        release(placement)
    for name in ("retry-after",):
        if name in upstream.headers:
            reply_headers[name] = upstream.headers[name]
    return Response(content, status_code=upstream.status_code, headers=reply_headers,
                    media_type=upstream.headers.get("content-type"))


async def _relay(upstream: httpx.Response, placement: Placement,
                 release: Callable[[Placement], None]) -> AsyncIterator[bytes]:
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()
        release(placement)
