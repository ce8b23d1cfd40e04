"""Token-exact failover of completions, streamed or not.

The router reads the worker's server-sent events as it relays them, keeping the token ids, the seed
and how much text the client has received. If the worker dies (connection error, or the stream ends
without `[DONE]`), hangs (no event within the token deadline) or fails the request (an error event),
the request continues on another worker from the prompt plus those token ids, with the same seed
(shoal's `resume_token_ids` / `resume_text_offset` extension). The client sees one stream: the same
response id, no repeated role chunk, no missing or repeated tokens; with a seed, the same tokens as
a run without the failure. Migrations are bounded per request. Non-streaming clients get the same
protection: the router streams from the worker and assembles the response itself.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field

import aiohttp
from starlette.responses import JSONResponse, Response, StreamingResponse

from shoal.router.balancer import Balancer, Placement
from shoal.router.config import FailoverSettings
from shoal.router.membership import Membership
from shoal.router.proxy import FORWARDED_HEADERS, error_response
from shoal.router.response_assembly import assemble
from shoal.router.views import RouteRequest

log = logging.getLogger(__name__)


class StreamBroken(Exception):
    """The worker stopped streaming before `[DONE]`."""


@dataclass
class StreamProgress:
    """What the client has received so far. Invariant: token_ids are exactly the tokens relayed."""

    token_ids: list[int] = field(default_factory=list)
    text_chars: int = 0
    seed: int | None = None
    response_id: str | None = None
    migrations: int = 0

    def resume_body(self, body: dict) -> dict:
        return {**body, "resume_token_ids": list(self.token_ids), "resume_text_offset": self.text_chars,
                "seed": self.seed if self.seed is not None else body.get("seed")}


class StreamFailover:
    """Invariant: at any time the request holds at most one placement; it is released when the
    worker is abandoned or the stream ends, and `done` runs exactly once at the end."""

    def __init__(self, session: aiohttp.ClientSession, balancer: Balancer, membership: Membership,
                 settings: FailoverSettings):
        self.session = session
        self.balancer = balancer
        self.membership = membership
        self.settings = settings

    async def open(self, routed: RouteRequest, body: dict, path: str, headers: Mapping[str, str],
                   placement: Placement, failed: set[str]) -> tuple[Placement | None, aiohttp.ClientResponse | None]:
        """Sends the request, moving to another worker while the chosen one cannot be reached or
        answers 5xx. Returns (None, None) when no worker is left to try."""
        outgoing = {k: headers[k] for k in FORWARDED_HEADERS if k in headers}
        for _ in range(self.settings.max_attempts):
            try:
                upstream = await self.session.post(placement.worker.url + path, json=body, headers=outgoing)
                if upstream.status < 500:
                    placement.worker.first_byte(placement.ticket)
                    return placement, upstream
                upstream.release()
                reason = f"answered {upstream.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                reason = type(exc).__name__
            self._abandon(placement, failed, reason)
            placement = self.balancer.place(routed, exclude=frozenset(failed))
            if placement is None:
                break
        return None, None

    def _abandon(self, placement: Placement, failed: set[str], reason: str) -> None:
        failed.add(placement.worker.worker_id)
        self.balancer.release(placement)
        self.membership.mark_failed(placement.worker.worker_id, reason)

    async def _start(self, routed: RouteRequest, body: dict, path: str, headers: Mapping[str, str],
                     placement: Placement, done: Callable[[], None], extra_headers: dict[str, str],
                     failed: set[str]) -> Response | tuple[Placement, aiohttp.ClientResponse, dict[str, str]]:
        """Opens the stream: (placement, upstream, reply headers), or a Response (the worker's
        refusal, or 503) when there is none to relay."""
        placement, upstream = await self.open(routed, body, path, headers, placement, failed)
        if upstream is None:
            done()
            return error_response(503, "no worker could take this request", "service_unavailable",
                                  headers={"retry-after": "1"})
        if upstream.status != 200 or not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            content = await upstream.read()
            upstream.release()
            self.balancer.release(placement)
            done()
            return Response(content, status_code=upstream.status, media_type=upstream.headers.get("content-type"),
                            headers={"x-shoal-worker": placement.worker.worker_id, **extra_headers})
        return placement, upstream, {"x-shoal-worker": placement.worker.worker_id, **extra_headers}

    async def relay(self, routed: RouteRequest, body: dict, path: str, headers: Mapping[str, str],
                    placement: Placement, done: Callable[[], None], extra_headers: dict[str, str]) -> Response:
        """A streaming client: the events are relayed as they come."""
        failed: set[str] = set()
        started = await self._start(routed, body, path, headers, placement, done, extra_headers, failed)
        if isinstance(started, Response):
            return started
        placement, upstream, reply_headers = started
        return StreamingResponse(self._events(routed, body, path, headers, placement, upstream, failed, done),
                                 media_type="text/event-stream", headers=reply_headers)

    async def collect(self, routed: RouteRequest, body: dict, path: str, headers: Mapping[str, str],
                      placement: Placement, done: Callable[[], None], extra_headers: dict[str, str],
                      chat: bool) -> Response:
        """A non-streaming client: the worker streams to the router (so a failure can be continued
        elsewhere) and the router answers with one assembled response."""
        failed: set[str] = set()
        body = {**body, "stream": True, "stream_options": {"include_usage": True}}
        started = await self._start(routed, body, path, headers, placement, done, extra_headers, failed)
        if isinstance(started, Response):
            return started
        placement, upstream, reply_headers = started
        events = [json.loads(chunk[6:]) async for chunk in
                  self._events(routed, body, path, headers, placement, upstream, failed, done)
                  if chunk.startswith(b"data: {")]
        errors = [e["error"] for e in events if "error" in e]
        if errors or not events:
            message = errors[0]["message"] if errors else "the worker sent no events"
            return error_response(503, message, "service_unavailable", headers={"retry-after": "1", **reply_headers})
        return JSONResponse(assemble(events, chat), headers=reply_headers)

    async def _events(self, routed: RouteRequest, body: dict, path: str, headers: Mapping[str, str],
                      placement: Placement, upstream: aiohttp.ClientResponse, failed: set[str],
                      done: Callable[[], None]) -> AsyncIterator[bytes]:
        progress = StreamProgress(seed=body.get("seed"))
        try:
            while True:
                try:
                    async for event in self._read(upstream, progress):
                        yield event
                    return
                except StreamBroken as broken:
                    upstream.release()
                    self._abandon(placement, failed, str(broken))
                    placement, upstream = None, None
                    if progress.migrations >= self.settings.max_attempts:
                        yield _error_event("the request failed on every worker tried")
                        return
                    if progress.text_chars and not progress.token_ids:
                        yield _error_event("the worker failed mid-stream and sent no token ids to resume from")
                        return
                    progress.migrations += 1
                    log.warning("migrating a stream after %d tokens (%s)", len(progress.token_ids), broken)
                    # Only shoal workers understand resume_token_ids; others could only start over.
                    others = {w.worker_id for w in self.membership.workers.values() if w.load_source != "shoal"}
                    exclude = failed | others if progress.token_ids else failed
                    next_placement = self.balancer.place(routed, exclude=frozenset(exclude))
                    if next_placement is not None:
                        placement, upstream = await self.open(routed, progress.resume_body(body), path, headers,
                                                              next_placement, failed)
                    if upstream is None or upstream.status != 200:
                        yield _error_event("no worker left to continue this stream")
                        return
        finally:
            if upstream is not None:
                upstream.release()
            if placement is not None:
                self.balancer.release(placement)
            done()

    async def _read(self, upstream: aiohttp.ClientResponse, progress: StreamProgress) -> AsyncIterator[bytes]:
        """Relays one worker's events, updating progress; raises StreamBroken if it stops short."""
        resumed = progress.migrations > 0
        while True:
            try:
                line = await asyncio.wait_for(upstream.content.readline(), self.settings.token_deadline_s)
            except TimeoutError:
                raise StreamBroken(f"no event within {self.settings.token_deadline_s} s") from None
            except aiohttp.ClientError as exc:
                raise StreamBroken(type(exc).__name__) from None
            if not line:
                raise StreamBroken("the stream ended without [DONE]")
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                yield b"data: [DONE]\n\n"
                return
            event = json.loads(payload)
            if "error" in event:
                raise StreamBroken(f"the worker failed the request: {event['error'].get('message')}")
            choice = (event.get("choices") or [{}])[0]
            token_ids = choice.get("token_ids") or []
            if resumed and event.get("choices") and not token_ids and not choice.get("finish_reason"):
                continue  # the continuation's opening role chunk: the client has it already
            progress.token_ids += token_ids
            progress.seed = choice.get("seed", progress.seed)
            progress.text_chars += len(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            if progress.response_id is None:
                progress.response_id = event.get("id")
            if resumed:
                event["id"] = progress.response_id
                payload = json.dumps(event).encode()
            yield b"data: " + payload + b"\n\n"


def _error_event(message: str) -> bytes:
    body = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": 503}}
    return b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n"
