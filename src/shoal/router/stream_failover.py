"""Token-exact failover of completions, streamed or not.

Before the first byte, a failed request (connection error, 5xx) is retried on another worker, never
one that already failed it, with exponential backoff and jitter, up to its priority's number of
attempts; critical requests then fall back along the model's chain. After that, the router reads
the worker's server-sent events as it relays them, keeping the token ids, the seed and how much
text the client has received. If the worker dies (connection error, or the stream ends without
`[DONE]`), hangs (no event within a deadline derived from its expected inter-token latency), is
found down or ejected by the health monitor (which severs its streams), or fails the request (an
error event), the request continues on another worker from the prompt plus those token ids, with
the same seed (shoal's `resume_token_ids` / `resume_text_offset` extension). The client sees one
stream: the same response id, no repeated role chunk, no missing or repeated tokens; with a seed,
the same tokens as a run without the failure. Migrations are bounded per request. Non-streaming
clients get the same protection: the router streams from the worker and assembles the response.
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field, replace

import aiohttp
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from shoal.router.balancer import Balancer, Placement
from shoal.router.choice_fanout import choice_bodies, merged
from shoal.router.config import FailoverSettings
from shoal.router.health_monitor import HealthMonitor
from shoal.router.membership import Membership, WorkerState
from shoal.router.proxy import FORWARDED_HEADERS, error_response
from shoal.router.request_telemetry import RequestTelemetry
from shoal.router.response_assembly import assemble
from shoal.router.views import RouteRequest

log = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"

# Errors that mean the worker's process or host is gone, not merely slow or failing requests.
CONNECTION_LOST = (aiohttp.ClientConnectorError, aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError)


class StreamBroken(Exception):
    """The worker stopped streaming before `[DONE]`; `connection_lost` when its connection broke."""

    def __init__(self, message: str, connection_lost: bool = False):
        super().__init__(message)
        self.connection_lost = connection_lost


@dataclass
class StreamProgress:
    """What the client has received so far. Invariant: token_ids are exactly the tokens relayed;
    `opened` once an opening (role) chunk was relayed, and only then."""

    token_ids: list[int] = field(default_factory=list)
    opened: bool = False
    text_chars: int = 0
    seed: int | None = None
    response_id: str | None = None
    migrations: int = 0

    def resume_body(self, body: dict) -> dict:
        return {**body, "resume_token_ids": list(self.token_ids), "resume_text_offset": self.text_chars,
                "seed": self.seed if self.seed is not None else body.get("seed")}


@dataclass
class Attempt:
    """The request as it stands: where it runs, and the model and body it runs with (a critical
    request may have fallen back to another model before its first byte); its telemetry."""

    routed: RouteRequest
    body: dict
    telemetry: RequestTelemetry
    placement: Placement | None = None
    upstream: aiohttp.ClientResponse | None = None


class StreamFailover:
    """Invariant: at any time the request holds at most one placement; it is released when the
    worker is abandoned or the stream ends, and `done` runs exactly once at the end. An open
    upstream is in its worker's `streams` (so the health monitor can sever it) until released."""

    def __init__(self, session: aiohttp.ClientSession, balancer: Balancer, membership: Membership,
                 monitor: HealthMonitor, settings: FailoverSettings, fallbacks: Callable[[str], list[str]],
                 unavailable_wait_s: float):
        self.session = session
        self.balancer = balancer
        self.membership = membership
        self.monitor = monitor
        self.settings = settings
        self.fallbacks = fallbacks
        self.unavailable_wait_s = unavailable_wait_s

    async def open(self, attempt: Attempt, path: str, headers: Mapping[str, str], failed: set[str],
                   resuming: bool) -> bool:
        """Sends the request, moving to another worker while the chosen one cannot be reached or
        answers 5xx. On success attempt.upstream is open; False when no worker is left to try."""
        forwarded = {k: headers[k] for k in FORWARDED_HEADERS if k in headers}
        for tried in range(self.settings.attempts[attempt.routed.priority]):
            if attempt.placement is None:
                return False
            if tried:
                await asyncio.sleep(self._backoff(tried))
            worker = attempt.placement.worker
            outgoing = dict(forwarded)
            attempt.telemetry.attempt(worker.worker_id, worker.url, resuming, outgoing)
            sent = time.monotonic()
            try:
                upstream = await self.session.post(worker.url + path, json=attempt.body, headers=outgoing)
                if upstream.status < 500:
                    if upstream.status == 200 and not resuming:  # shoal workers answer at the first token
                        worker.latency.observe_ttft(time.monotonic() - sent)
                    worker.first_byte(attempt.placement.ticket)
                    self.monitor.request_succeeded(worker)
                    attempt.upstream = upstream
                    worker.streams.add(upstream)
                    return True
                upstream.release()
                reason, lost = f"answered {upstream.status}", False
            except (aiohttp.ClientError, TimeoutError) as exc:
                reason, lost = type(exc).__name__, isinstance(exc, CONNECTION_LOST)
            attempt.telemetry.end_attempt("failed", reason)
            attempt.telemetry.retried(worker.worker_id, reason)
            log.info("%s failed the request (%s); trying another worker", worker.worker_id, reason)
            self._abandon(attempt, failed, reason, lost)
            attempt.placement = await self._place(attempt, failed, resuming, wait=False)
        return False

    def _backoff(self, tried: int) -> float:
        """Exponential, capped, half of it jittered."""
        delay = min(self.settings.backoff_max_s, self.settings.backoff_base_s * 2 ** (tried - 1))
        return delay / 2 + random.uniform(0, delay / 2)

    async def _place(self, attempt: Attempt, failed: set[str], resuming: bool, wait: bool) -> Placement | None:
        """Another worker for the request: of its model (a resumed stream only on shoal workers, the
        only ones that take resume_token_ids), else for a critical request one of a fallback model
        (never mid-stream: token ids are the model's own). With `wait`, waits up to
        unavailable_wait_s for one to become available."""
        deadline = time.monotonic() + (self.unavailable_wait_s if wait else 0)
        while True:
            exclude = set(failed)
            if resuming:
                exclude |= {w.worker_id for w in self.membership.workers.values() if w.load_source != "shoal"}
            started_ns = time.time_ns()
            placement = self.balancer.place(attempt.routed, exclude=frozenset(exclude))
            attempt.telemetry.placed(attempt.routed, placement, self.balancer.policy.name, started_ns)
            if placement is None and not resuming and attempt.routed.priority == "critical":
                for model in self.fallbacks(attempt.routed.model):
                    placement = self.balancer.place(replace(attempt.routed, model=model), exclude=frozenset(failed))
                    if placement is not None:
                        log.warning("critical request falls back from %s to %s", attempt.routed.model, model)
                        attempt.routed = replace(attempt.routed, model=model)
                        attempt.body = {**attempt.body, "model": model}
                        break
            if placement is not None or time.monotonic() >= deadline:
                return placement
            await asyncio.sleep(0.05)

    def _abandon(self, attempt: Attempt, failed: set[str], reason: str, connection_lost: bool) -> None:
        """Gives up the current worker for this request; counts the failure unless the health
        monitor itself took the worker out (and severed the stream)."""
        worker = attempt.placement.worker
        failed.add(worker.worker_id)
        if attempt.upstream is not None:
            worker.streams.discard(attempt.upstream)
            attempt.upstream.release()
            attempt.upstream = None
        self.balancer.release(attempt.placement)
        attempt.placement = None
        if not worker.down and worker.ejected_until is None:
            self.monitor.request_failed(worker, reason, connection_lost)

    def _finish(self, attempt: Attempt) -> None:
        if attempt.upstream is not None:
            attempt.placement.worker.streams.discard(attempt.upstream)
            attempt.upstream.release()
            attempt.upstream = None
        if attempt.placement is not None:
            self.balancer.release(attempt.placement)
            attempt.placement = None

    async def _start(self, attempt: Attempt, path: str, headers: Mapping[str, str],
                     failed: set[str]) -> Response | None:
        """Opens the stream; None when there is one to relay, else the Response to answer (the
        worker's refusal, or 503)."""
        if not await self.open(attempt, path, headers, failed, resuming=False):
            return error_response(503, "no worker could take this request", "service_unavailable",
                                  headers={"retry-after": "1"})
        upstream, worker = attempt.upstream, attempt.placement.worker
        if upstream.status != 200 or not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            content = await upstream.read()
            self._finish(attempt)
            return Response(content, status_code=upstream.status, media_type=upstream.headers.get("content-type"),
                            headers={"x-shoal-worker": worker.worker_id})
        return None

    async def serve(self, routed: RouteRequest, body: dict, path: str, headers: Mapping[str, str],
                    placement: Placement, done: Callable[[], None], extra_headers: dict[str, str],
                    chat: bool, telemetry: RequestTelemetry) -> Response:
        """Serves a completion, streamed or not, with any number of choices; `done` runs once when
        it is over (also when the client leaves before the stream is read). A stream's end also
        finishes its telemetry (any other response's status is the caller's to record)."""
        streaming = body.get("stream") is True
        bodies = choice_bodies(body, force_stream=not streaming)
        attempts = [Attempt(routed, b, telemetry, placement if i == 0 else self.balancer.place(routed))
                    for i, b in enumerate(bodies)]
        finished = False

        def finish() -> None:
            nonlocal finished
            if not finished:
                finished = True
                for attempt in attempts:
                    self._finish(attempt)
                done()

        def stream_over() -> None:
            finish()
            telemetry.finish(200)

        failed_per_choice = [set() for _ in attempts]
        try:
            for attempt, failed in zip(attempts, failed_per_choice):
                refusal = await self._start(attempt, path, headers, failed)
                if refusal is not None:
                    finish()
                    refusal.headers.update(extra_headers)
                    return refusal
        except BaseException:  # a worker's broken refusal, or the client gone while we retried
            finish()
            raise
        reply_headers = {"x-shoal-worker": attempts[0].placement.worker.worker_id, **extra_headers}
        if attempts[0].routed.model != routed.model:
            reply_headers["x-shoal-degraded"] = f"fallback={attempts[0].routed.model}"
        streams = [self._events(a, path, headers, f) for a, f in zip(attempts, failed_per_choice)]
        events = streams[0] if len(streams) == 1 else merged(streams, _wants_usage(body) or not streaming)
        if streaming:
            return StreamingResponse(_finally(events, stream_over), media_type="text/event-stream",
                                     headers=reply_headers, background=BackgroundTask(stream_over))
        try:
            collected = [json.loads(chunk[6:]) async for chunk in events if chunk.startswith(b"data: {")]
        finally:
            finish()
        errors = [e["error"] for e in collected if "error" in e]
        if errors or not collected:
            message = errors[0]["message"] if errors else "the worker sent no events"
            return error_response(503, message, "service_unavailable", headers={"retry-after": "1", **reply_headers})
        return JSONResponse(assemble(collected, chat), headers=reply_headers)

    async def _events(self, attempt: Attempt, path: str, headers: Mapping[str, str],
                      failed: set[str]) -> AsyncIterator[bytes]:
        progress = StreamProgress(seed=attempt.body.get("seed"))
        original_body = attempt.body
        try:
            while True:
                try:
                    async for event in self._read(attempt.upstream, attempt.placement.worker, progress,
                                                  attempt.telemetry):
                        yield event
                    return
                except StreamBroken as broken:
                    worker_id = attempt.placement.worker.worker_id
                    attempt.telemetry.end_attempt("broken", str(broken))
                    self._abandon(attempt, failed, str(broken), broken.connection_lost)
                    if progress.migrations >= self.settings.max_migrations:
                        yield _gave_up(attempt, "the request failed on every worker tried")
                        yield DONE
                        return
                    if progress.text_chars and not progress.token_ids:
                        yield _gave_up(attempt, "the worker failed mid-stream and sent no token ids to resume from")
                        yield DONE
                        return
                    progress.migrations += 1
                    log.warning("migrating a stream (%s, seed %s) from %s after %d tokens (%s)", progress.response_id,
                                progress.seed, worker_id, len(progress.token_ids), broken)
                    attempt.telemetry.migrated(worker_id, len(progress.token_ids), str(broken))
                    resuming = bool(progress.token_ids)
                    attempt.body = progress.resume_body(original_body) if resuming else original_body
                    attempt.placement = await self._place(attempt, failed, resuming, wait=True)
                    if not await self.open(attempt, path, headers, failed, resuming) or attempt.upstream.status != 200:
                        yield _gave_up(attempt, "no worker left to continue this stream")
                        yield DONE
                        return
        finally:
            self._finish(attempt)
    def _token_deadline(self, worker: WorkerState, first: bool) -> float:
        """Seconds without an event after which the stream is taken as hung."""
        expected = None if first else worker.expected_itl_s()
        if expected is None:
            return self.settings.token_deadline_max_s
        return min(max(self.settings.token_deadline_factor * expected, self.settings.token_deadline_min_s),
                   self.settings.token_deadline_max_s)

    async def _read(self, upstream: aiohttp.ClientResponse, worker: WorkerState, progress: StreamProgress,
                    telemetry: RequestTelemetry) -> AsyncIterator[bytes]:
        """Relays one worker's events, updating progress and the worker's latency figures; raises
        StreamBroken if it stops short."""
        resumed = progress.migrations > 0
        last = time.monotonic()
        first = True
        while True:
            deadline = self._token_deadline(worker, first)
            try:
                line = await asyncio.wait_for(upstream.content.readline(), deadline)
            except TimeoutError:
                raise StreamBroken(f"no event within {deadline:.1f} s") from None
            except aiohttp.ClientError as exc:
                raise StreamBroken(type(exc).__name__, connection_lost=True) from None
            if not line:
                raise StreamBroken("the stream ended without [DONE]", connection_lost=True)
            if not line.startswith(b"data: "):
                continue
            payload = line[6:].strip()
            if payload == b"[DONE]":
                yield DONE
                return
            event = json.loads(payload)
            if "error" in event:
                raise StreamBroken(f"the worker failed the request: {event['error'].get('message')}")
            choice = (event.get("choices") or [{}])[0]
            token_ids = choice.get("token_ids") or []
            if token_ids:
                now = time.monotonic()
                if not first:
                    worker.latency.observe_itl((now - last) / len(token_ids))
                last, first = now, False
                telemetry.tokens(len(token_ids))
            opening = bool(event.get("choices")) and not token_ids and not choice.get("finish_reason")
            if opening and progress.opened:
                continue  # a continuation's opening role chunk: the client has one already
            progress.opened = progress.opened or opening
            progress.token_ids += token_ids
            progress.seed = choice.get("seed", progress.seed)
            progress.text_chars += len(choice.get("text") or (choice.get("delta") or {}).get("content") or "")
            if progress.response_id is None:
                progress.response_id = event.get("id")
            if resumed:
                event["id"] = progress.response_id
                payload = json.dumps(event).encode()
            yield b"data: " + payload + b"\n\n"


async def _finally(events: AsyncIterator[bytes], finish: Callable[[], None]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield event
    finally:
        finish()


def _wants_usage(body: dict) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))


def _gave_up(attempt: Attempt, message: str) -> bytes:
    """The error event that ends a stream no worker could finish (its trace marked failed)."""
    attempt.telemetry.failed(message)
    return _error_event(message)


def _error_event(message: str) -> bytes:
    """One server-sent event (each chunk this module yields is exactly one)."""
    body = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": 503}}
    return b"data: " + json.dumps(body).encode() + b"\n\n"
