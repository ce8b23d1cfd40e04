"""One request's whole trace as the router shows it: its own spans, and those of every worker an
attempt reached, fetched from the workers' in-memory traces (`GET /debug/traces/{trace_id}`).
Spans exported over OTLP are assembled by the collector instead."""

from __future__ import annotations

import asyncio
import re

import aiohttp

from shoal.observability.tracing import Tracing

TRACE_ID = re.compile(r"^[0-9a-f]{32}$")
WORKER_TIMEOUT_S = 2.0


async def whole_trace(tracing: Tracing, session: aiohttp.ClientSession | None, trace_id: str) -> list[dict]:
    """The trace's spans in start order. A worker that is gone or slow to answer only leaves its
    own spans out."""
    if not TRACE_ID.match(trace_id):
        return []
    spans = tracing.recent.spans(trace_id)
    workers = sorted(
        {
            s["attributes"]["server.address"]
            for s in spans
            if s["name"] == "router.attempt" and "server.address" in s["attributes"]
        }
    )
    if session is not None and workers:
        fetched = await asyncio.gather(*(_worker_spans(session, url, trace_id) for url in workers))
        spans += [span for found in fetched for span in found]
    return sorted(spans, key=lambda s: s["start_ns"])


async def _worker_spans(session: aiohttp.ClientSession, url: str, trace_id: str) -> list[dict]:
    try:
        async with session.get(
            f"{url}/debug/traces/{trace_id}", timeout=aiohttp.ClientTimeout(total=WORKER_TIMEOUT_S)
        ) as reply:
            return (await reply.json())["spans"] if reply.status == 200 else []
    except (aiohttp.ClientError, TimeoutError, ValueError, KeyError):
        return []
