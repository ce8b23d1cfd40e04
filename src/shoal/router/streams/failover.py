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
the same tokens as a run without the failure. A stream that started on another engine (vLLM,
llama.cpp), or that only such engines can take, continues token-exact where a shoal worker can take
its token ids, else as text (stream_continuation.py says which engine gets which guarantee).
Migrations are bounded per request. A worker left
for looking hung may take the stream again once it answers (tried_workers.py); while no worker can
take it, the stream waits for one (up to failover.wait_for_capacity_s, never past the request's
x-shoal-deadline-s), with keep-alives to the client.
A planned move is a handoff (shoal.protocol.kv_handoff): a prefill worker after the first token,
a draining worker at its next one. The stream continues in the decode phase (worker_roles), and
the next worker imports the KV from the one that handed it off (`kv_source`) instead of computing
it; so does the next worker of a stream moved off a worker the health monitor ejected while it still
answers. A crash still costs a recompute.
Non-streaming clients get the same protection: the router streams from the worker and assembles
the response. An error event with a 4xx code is the request's own fault (its grammar allows no
token of the model's vocabulary, say): no worker would do better, so it reaches the client as it is.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable

import msgspec
from msgspec.structs import replace
from starlette.background import BackgroundTask
from starlette.responses import JSONResponse, Response, StreamingResponse

from shoal.errors import error_body
from shoal.protocol.keep_alive import BARE, CLIENT_INTERVAL_S
from shoal.protocol.keep_alive import REQUEST_HEADER as KEEP_ALIVE_HEADER
from shoal.protocol.kv_handoff import ACCEPTS_KV_HANDOFF, HANDOFF_HEADER, MAX_HANDOFFS, Handoff
from shoal.protocol.sse import DONE, data_event, data_values, is_done, json_data
from shoal.router.config import FailoverSettings
from shoal.router.fleet.health_monitor import HealthMonitor
from shoal.router.fleet.membership import Membership
from shoal.router.fleet.worker_state import WorkerState
from shoal.router.lora_catalog import AdapterLoadFailed, LoraCatalog
from shoal.router.placement.balancer import Balancer, Placement
from shoal.router.streams.assembly import assemble
from shoal.router.streams.attempt import Attempt
from shoal.router.streams.choice_fanout import choice_bodies, merged
from shoal.router.streams.continuation import by_tokens
from shoal.router.streams.proxy import FORWARDED_HEADERS, JSON_CONTENT, error_response
from shoal.router.streams.relay import HandedOff, StreamBroken, StreamProgress, is_client_error, relay
from shoal.router.streams.request_context import RequestContext
from shoal.router.streams.upstream_client import UpstreamClient, UpstreamError

log = logging.getLogger(__name__)


class StreamFailover:
    """Invariant: at any time the request holds at most one placement; it is released when the
    worker is abandoned or the stream ends, and `done` runs exactly once at the end. An open
    upstream is in its worker's `streams` (so the health monitor can sever it) until released."""

    def __init__(
        self,
        client: UpstreamClient,
        balancer: Balancer,
        membership: Membership,
        monitor: HealthMonitor,
        settings: FailoverSettings,
        fallbacks: Callable[[str], list[str]],
        lora: LoraCatalog | None = None,
    ):
        self.client = client
        self.balancer = balancer
        self.membership = membership
        self.monitor = monitor
        self.settings = settings
        self.fallbacks = fallbacks
        self.lora = lora

    async def open(self, attempt: Attempt) -> bool:
        """Sends the request, moving to another worker while the chosen one cannot be reached or
        answers 5xx. On success attempt.upstream is open; False when no worker is left to try."""
        request = attempt.request
        headers, telemetry = request.headers, request.telemetry
        forwarded = {**JSON_CONTENT, **{k: headers[k] for k in FORWARDED_HEADERS if k in headers}}
        resuming = attempt.continues is not None
        for try_number in range(self.settings.attempts_for(attempt.routed.priority)):
            if attempt.placement is None:
                return False
            if try_number:
                await asyncio.sleep(self._backoff(try_number))
            worker = attempt.placement.worker
            outgoing = {**forwarded, KEEP_ALIVE_HEADER: "1"}  # the keep-alives that tell busy from hung
            if _may_hand_off(attempt, worker, resuming):
                outgoing[HANDOFF_HEADER] = ACCEPTS_KV_HANDOFF
            telemetry.attempt(worker.worker_id, worker.url, attempt.continuation(worker), outgoing)
            sent = time.monotonic()
            try:
                if attempt.routed.adapter_loadable and self.lora is not None:
                    await self.lora.ensure(worker, attempt.routed.model)
                # Until the first byte (a shoal worker answers at the first token) the health
                # monitor may cut the wait short: it closes what is in worker.streams.
                upstream = await self.client.post(
                    worker.url + request.path,
                    msgspec.json.encode(attempt.body_for(worker)),
                    outgoing,
                    track=worker.streams,
                )
                if upstream.status < 500:
                    if upstream.status == 200 and not resuming:
                        worker.latency.observe_ttft(time.monotonic() - sent)
                    worker.first_byte(attempt.placement.ticket)
                    self.monitor.request_succeeded(worker)
                    attempt.upstream = upstream
                    return True
                worker.streams.discard(upstream)
                upstream.release()
                reason, lost, refused_for_now = f"answered {upstream.status}", False, upstream.status == 503
            except AdapterLoadFailed as exc:  # the adapter's fault, not the worker's health
                telemetry.end_attempt("failed", str(exc))
                log.warning("%s could not load the LoRA adapter %s: %s", worker.worker_id, attempt.routed.model, exc)
                self._abandon(attempt, str(exc), connection_lost=False, counted=False)
                attempt.placement = self._place(attempt)
                continue
            except (UpstreamError, TimeoutError) as exc:
                lost = isinstance(exc, UpstreamError) and exc.connection_lost
                reason, refused_for_now = type(exc).__name__, False
            telemetry.end_attempt("failed", reason)
            telemetry.retried(worker.worker_id, reason)
            log.info("%s failed the request (%s); trying another worker", worker.worker_id, reason)
            self._abandon(attempt, reason, lost, may_retake=refused_for_now)
            attempt.placement = self._place(attempt)
        return False

    def _backoff(self, try_number: int) -> float:
        """Exponential, capped, half of it jittered."""
        delay = min(self.settings.backoff_max_s, self.settings.backoff_base_s * 2 ** (try_number - 1))
        return delay / 2 + random.uniform(0, delay / 2)

    def _place(self, attempt: Attempt) -> Placement | None:
        """Another worker for the request, now or None: of its model (a continued stream only on a
        worker whose engine can continue it, token-exact where one can), else for a critical request
        one of a fallback model (never mid-stream: the output so far is the model's own)."""
        excluded = attempt.tried.excluded(self.membership.workers)
        started_ns = time.time_ns()
        placement, progress = None, attempt.continues
        if progress is not None:
            workers = self.membership.workers.values()
            for fits in (lambda w: by_tokens(w.engine, progress), attempt.takes):
                exclude = excluded | {w.worker_id for w in workers if not fits(w)}
                placement = self.balancer.place(attempt.routed, exclude=frozenset(exclude), phase="decode")
                if placement is not None:
                    break
        else:
            placement = self.balancer.place(attempt.routed, exclude=excluded, phase="prefill")
        attempt.request.telemetry.placed(attempt.routed, placement, self.balancer.policy.name, started_ns)
        if placement is None and progress is None and attempt.routed.priority == "critical":
            for model in self.fallbacks(attempt.routed.model):
                placement = self.balancer.place(replace(attempt.routed, model=model), exclude=excluded)
                if placement is not None:
                    log.warning("critical request falls back from %s to %s", attempt.routed.model, model)
                    attempt.routed = replace(attempt.routed, model=model)
                    attempt.body = {**attempt.body, "model": model}
                    break
        return placement

    def _abandon(
        self,
        attempt: Attempt,
        reason: str,
        connection_lost: bool,
        may_retake: bool = False,
        counted: bool = True,
    ) -> None:
        """Gives up the current worker for this request: for good if it failed it (a 5xx other than
        503, an error event), until it answers again if it looked hung or refused the request for now
        (`may_retake`: a 503 from a draining or overloaded worker), lost the connection (its process
        or host is gone; restarted, it may take the request again) or the health monitor took it
        out (severing the stream). Counts the failure (`counted`: it was the worker's) unless the
        health monitor took it out."""
        worker = attempt.placement.worker
        taken_out = worker.down or worker.ejected_until is not None
        if may_retake or taken_out or connection_lost:
            attempt.tried.leave(worker.worker_id, time.monotonic())
        else:
            attempt.tried.fail(worker.worker_id)
        if attempt.upstream is not None:
            worker.streams.discard(attempt.upstream)
            attempt.upstream.release()
            attempt.upstream = None
        self.balancer.release(attempt.placement)
        attempt.placement = None
        if counted and not taken_out:
            self.monitor.request_failed(worker, reason, connection_lost)

    def _continuable(self, attempt: Attempt) -> bool:
        """Whether any worker of the request's model, up or not, has an engine that can continue it."""
        return any(
            attempt.takes(w)
            for w in self.membership.workers.values()
            if w.serves(attempt.routed.model, attempt.routed.loadable_of)
        )

    def _hand_over(self, attempt: Attempt, progress: StreamProgress, handoff: Handoff) -> None:
        """Lets the worker that handed the stream off go (it did nothing wrong): not counted as a
        failure nor a migration; past MAX_HANDOFFS the next worker may not hand it off again."""
        worker = attempt.placement.worker
        telemetry = attempt.request.telemetry
        telemetry.end_attempt("handed_off", None)
        telemetry.handed_off(worker.worker_id, len(progress.token_ids), handoff.reason)
        progress.handoffs += 1
        attempt.accepts_handoff = progress.handoffs < MAX_HANDOFFS
        self._finish(attempt)

    def _finish(self, attempt: Attempt) -> None:
        if attempt.upstream is not None:
            attempt.placement.worker.streams.discard(attempt.upstream)
            attempt.upstream.release()
            attempt.upstream = None
        if attempt.placement is not None:
            self.balancer.release(attempt.placement)
            attempt.placement = None

    async def _start(self, attempt: Attempt) -> Response | None:
        """Opens the stream; None when there is one to relay, else the Response to answer (the
        worker's refusal, or 503, with the request's `extra_headers`). While no worker can take it
        the request waits up to its `wait_s`, unless every worker of its model has failed it."""
        extra_headers = attempt.request.extra_headers
        if attempt.placement is not None and not attempt.takes(attempt.placement.worker):
            self.balancer.release(attempt.placement)
            attempt.placement = self._place(attempt)
        if not await self.open(attempt) and not attempt.tried.failed_by_all(self.membership.workers, attempt.routed):
            async for _ in self._reopen(attempt):
                pass  # nothing is sent before the first byte: the client just waits
        if attempt.upstream is None:
            return error_response(
                503,
                "no worker could take this request",
                "service_unavailable",
                headers={"retry-after": "1", **extra_headers},
            )
        upstream, worker = attempt.upstream, attempt.placement.worker
        if upstream.status != 200 or not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            content = await upstream.read()
            self._finish(attempt)
            return Response(
                content,
                status_code=upstream.status,
                media_type=upstream.headers.get("content-type"),
                headers={"x-shoal-worker": worker.worker_id, **extra_headers},
            )
        return None

    async def serve_whole(self, request: RequestContext, placement: Placement, done: Callable[[], None]) -> Response:
        """Serves a request a worker answers in one body (embeddings), sent as a stream's first
        attempt is: to another worker while one cannot be reached or answers 5xx, waiting up to
        the request's `wait_s` for one; `done` runs once."""
        attempt = Attempt(request, request.body, placement)
        try:
            answer = await self._start(attempt)
        finally:
            self._finish(attempt)
            done()
        if answer is None:  # a stream where one body was due
            return error_response(502, "the worker answered with a stream", "bad_gateway")
        return answer

    async def serve(
        self,
        request: RequestContext,
        placement: Placement,
        done: Callable[[], None],
        resume: StreamProgress | None = None,
    ) -> Response:
        """Serves a completion, streamed or not, with any number of choices; `done` runs once when
        it is over (also when the client leaves before the stream is read). A stream's end also
        finishes its telemetry (any other response's status is the caller's to record). A stream
        with no worker to continue on waits up to the request's `wait_s` for one. With the
        request's `journal` (a single-choice stream) every event gets an id and the journal follows
        the stream; `resume` continues a journaled stream from where its client stands (what it was
        sent is not sent again)."""
        body = request.body
        streaming = body.get("stream") is True
        bodies = choice_bodies(body, force_stream=not streaming)
        attempts = [
            Attempt(request, b, placement if i == 0 else self.balancer.place(request.routed))
            for i, b in enumerate(bodies)
        ]
        progresses = [StreamProgress(seed=b.get("seed")) for b in bodies]
        if resume is not None:
            progresses[0] = resume
            attempts[0].continues = resume
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
            request.telemetry.finish(200)

        async def after_the_response() -> None:  # a coroutine: Starlette runs a plain function in a thread
            stream_over()

        try:
            for attempt in attempts:
                refusal = await self._start(attempt)
                if refusal is not None:
                    finish()
                    return refusal
        except BaseException:  # a worker's broken refusal, or the client gone while we retried
            finish()
            raise
        reply_headers = {"x-shoal-worker": attempts[0].placement.worker.worker_id, **request.extra_headers}
        if attempts[0].routed.model != request.routed.model:
            reply_headers["x-shoal-degraded"] = f"fallback={attempts[0].routed.model}"
        streams = [self._events(a, p) for a, p in zip(attempts, progresses)]
        events = streams[0] if len(streams) == 1 else merged(streams, _wants_usage(body) or not streaming)
        if streaming:
            return StreamingResponse(
                _finally(events, stream_over),
                media_type="text/event-stream",
                headers=reply_headers,
                background=BackgroundTask(after_the_response),
            )
        try:
            collected = [json_data(data) async for chunk in events for data in data_values(chunk) if not is_done(data)]
        finally:
            finish()
        errors = [e["error"] for e in collected if "error" in e]
        refusal = next((e for e in collected if is_client_error(e)), None)
        if refusal is not None:
            return JSONResponse(refusal, status_code=refusal["error"]["code"], headers=reply_headers)
        if errors or not collected:
            message = errors[0]["message"] if errors else "the worker sent no events"
            return error_response(503, message, "service_unavailable", headers={"retry-after": "1", **reply_headers})
        return JSONResponse(assemble(collected, request.chat), headers=reply_headers)

    async def _events(self, attempt: Attempt, progress: StreamProgress) -> AsyncIterator[bytes]:
        telemetry, journal = attempt.request.telemetry, attempt.request.journal
        try:
            while True:
                try:
                    async for event in relay(
                        attempt.upstream,
                        attempt.placement.worker,
                        progress,
                        telemetry,
                        self.settings,
                        attempt.placement.ticket,
                        event_ids=journal is not None,
                    ):
                        yield event
                        if journal is not None:
                            journal.advance(progress)
                    if journal is not None:
                        await journal.finish(progress)
                    return
                except HandedOff as moved:
                    self._hand_over(attempt, progress, moved.handoff)
                    attempt.continues, attempt.kv_source = progress, moved.handoff.kv_peer
                except StreamBroken as broken:
                    worker_id = attempt.placement.worker.worker_id
                    telemetry.end_attempt("broken", str(broken))
                    self._abandon(attempt, str(broken), broken.connection_lost, may_retake=broken.timed_out)
                    if progress.migrations >= self.settings.max_migrations:
                        yield _gave_up(attempt, "the request failed on every worker tried")
                        yield DONE
                        return
                    started = bool(progress.tokens or progress.text_chars)
                    attempt.continues = progress if started else None
                    if started and not self._continuable(attempt):
                        yield _gave_up(attempt, "the worker failed mid-stream and no worker can continue its output")
                        yield DONE
                        return
                    progress.migrations += 1
                    log.warning(
                        "migrating a stream (%s, seed %s) from %s after %d tokens (%s)",
                        progress.response_id,
                        progress.seed,
                        worker_id,
                        progress.tokens,
                        broken,
                    )
                    telemetry.migrated(worker_id, progress.tokens, str(broken))
                    attempt.kv_source = _ejected_kv_peer(self.membership, worker_id) if started else None
                async for keep_alive in self._reopen(attempt):
                    yield keep_alive
                if attempt.upstream is None or attempt.upstream.status != 200:
                    yield _gave_up(attempt, "no worker left to continue this stream")
                    yield DONE
                    return
        finally:
            self._finish(attempt)

    async def catch_up(self, request: RequestContext, progress: StreamProgress, tokens: int) -> None:
        """Regenerates, without relaying them, the tokens of a journaled stream from its journal's
        mark up to `tokens` (what its client had been sent): the same seed gives the same tokens at
        the same positions. progress.token_ids then holds exactly `tokens` ids. Raises
        StreamBroken when no worker could do it."""
        scratch = StreamProgress(progress.token_ids[:], True, progress.text_chars, progress.seed, progress.response_id)
        placement = self.balancer.place(request.routed, phase="decode")
        attempt = Attempt(request, request.body, placement, accepts_handoff=False, continues=scratch)
        if not await self.open(attempt):
            raise StreamBroken("no worker could regenerate the stream up to where its client stood")
        try:
            async for _ in relay(
                attempt.upstream,
                attempt.placement.worker,
                scratch,
                request.telemetry,
                self.settings,
                attempt.placement.ticket,
            ):
                if len(scratch.token_ids) >= tokens:
                    break
        finally:
            self._finish(attempt)
        if len(scratch.token_ids) < tokens:
            raise StreamBroken("the stream ended before reaching where its client stood")
        progress.token_ids = scratch.token_ids[:tokens]
        progress.seed = scratch.seed

    async def _reopen(self, attempt: Attempt) -> AsyncIterator[bytes]:
        """Opens the stream on another worker (attempt.upstream), waiting up to the request's wait_s
        while none can take it (every one tried, down or busy); yields keep-alives for the client
        meanwhile. attempt.upstream stays None if no worker took it by then."""
        now = time.monotonic()
        deadline, keep_alive_at = now + attempt.request.wait_s, now + CLIENT_INTERVAL_S
        while True:
            attempt.placement = self._place(attempt)
            if attempt.placement is not None and await self.open(attempt):
                return
            now = time.monotonic()
            if now >= deadline:
                return
            if now >= keep_alive_at:
                keep_alive_at = now + CLIENT_INTERVAL_S
                yield BARE
            await asyncio.sleep(0.05)


async def _finally(events: AsyncIterator[bytes], finish: Callable[[], None]) -> AsyncIterator[bytes]:
    try:
        async for event in events:
            yield event
    finally:
        finish()


def _may_hand_off(attempt: Attempt, worker: WorkerState, resuming: bool) -> bool:
    """Whether the worker may hand this attempt's stream off: a shoal worker, within the stream's
    handoffs, and not a prefill worker taking a continuation (it got one: no other is up)."""
    return attempt.accepts_handoff and worker.engine == "shoal" and not (resuming and worker.role == "prefill")


def _ejected_kv_peer(membership: Membership, worker_id: str) -> str | None:
    """The KV peer of a worker ejected while it still answers (its blocks are likely still there)."""
    worker = membership.workers.get(worker_id)
    if worker is None or worker.down or worker.ejected_until is None or worker.report is None:
        return None
    return worker.report.kv_peer


def _wants_usage(body: dict) -> bool:
    return bool((body.get("stream_options") or {}).get("include_usage"))


def _gave_up(attempt: Attempt, message: str) -> bytes:
    """The error event that ends a stream no worker could finish (its trace marked failed)."""
    attempt.request.telemetry.failed(message)
    return _error_event(message)


def _error_event(message: str) -> bytes:
    """One server-sent event (each chunk this module yields is exactly one)."""
    return data_event(error_body(message, 503, "service_unavailable"))
