"""The path of one client request through the router: authenticate, parse, rate-limit, degrade if
saturated, admit, place, forward. Each step answers with an OpenAI-shaped error when it refuses."""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Mapping

import msgspec
from msgspec.structs import replace
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from shoal.observability.cluster_events import ClusterEvents
from shoal.observability.tracing import Tracing
from shoal.protocol.prefix_keys import salted_blocks
from shoal.protocol.request_body import body_within
from shoal.router.admission.auth import ApiKeys, Client, authorization
from shoal.router.admission.queues import Admission, Refused, Share
from shoal.router.admission.rate_limit import RateLimiter
from shoal.router.admission.slots import GroupSlots, LocalSlots
from shoal.router.config import RouterConfig
from shoal.router.fleet.circuit_breaker import BreakerState
from shoal.router.fleet.health_monitor import HealthMonitor
from shoal.router.fleet.membership import Membership
from shoal.router.lora_catalog import LoraCatalog
from shoal.router.metrics import RouterMetrics
from shoal.router.placement.balancer import Balancer
from shoal.router.placement.latency_targets import TPOT_HEADER, TTFT_HEADER, BadTarget, late, with_targets
from shoal.router.placement.route_request import EMBEDDINGS_PATH, RequestError, embedding_route_request, route_request
from shoal.router.request_telemetry import RequestTelemetry
from shoal.router.streams.failover import StreamFailover
from shoal.router.streams.journal import EventId, Journaled, ResumeRefused, StreamJournal
from shoal.router.streams.proxy import error_response
from shoal.router.streams.relay import StreamBroken, StreamProgress
from shoal.router.streams.request_context import RequestContext
from shoal.router.streams.upstream_client import UpstreamClient
from shoal.router.views import RouteRequest


class FrontDoor:
    """Invariant: an admitted request releases its admission slot and its placement exactly once,
    when its response ends (or at once if it never reaches a worker)."""

    def __init__(
        self,
        config: RouterConfig,
        membership: Membership,
        balancer: Balancer,
        monitor: HealthMonitor,
        tracing: Tracing,
        metrics: RouterMetrics,
        events: ClusterEvents | None = None,
        slots: LocalSlots | GroupSlots | None = None,
        router_id: str | None = None,
        lora: LoraCatalog | None = None,
    ):
        self.config = config
        self.lora = lora  # the LoRA adapters this router loads onto workers on demand
        self.tracing, self.metrics = tracing, metrics
        self.events = events if events is not None else ClusterEvents()  # failovers go to the feed
        self.membership = membership
        self.balancer = balancer
        self.monitor = monitor
        self.failover: StreamFailover | None = None
        self.journal: StreamJournal | None = None  # with resumable_streams.store: redis
        # Named in every response (x-shoal-router); a router group's member adds its number.
        self.router_id = router_id or f"{config.host}:{config.port}"
        self.api_keys = ApiKeys(config)
        self.rate_limiter = RateLimiter()
        settings = config.admission
        self.admission = Admission(
            self.capacity, settings.queue_limits, settings.queue_timeout_s, settings.retry_after_s, slots
        )

    def open(self, client: UpstreamClient) -> None:
        """Called by the app's lifespan, inside the event loop, with the client to the workers."""
        if self.config.resumable_streams.store == "redis":
            self.journal = StreamJournal.open(self.config.resumable_streams)
        self.failover = StreamFailover(
            client,
            self.balancer,
            self.membership,
            self.monitor,
            self.config.failover,
            self.fallbacks,
            self.lora,
        )

    async def close(self) -> None:
        if self.journal is not None:
            await self.journal.close()

    def capacity(self, model: str) -> int:
        """Slots for a model: max_in_flight_per_worker for each available worker serving it (or
        able to load it: a LoRA adapter of the catalog), and one for a worker whose half-open
        breaker lets a single probe through."""
        per_worker = self.config.admission.max_in_flight_per_worker
        source = self.lora.sources.get(model) if self.lora is not None else None
        loadable_of = source.base if source is not None else None
        return sum(
            per_worker if w.breaker.state is BreakerState.CLOSED else 1
            for w in self.membership.workers.values()
            if w.available and (model in w.models or (loadable_of is not None and w.serves(model, loadable_of)))
        )

    async def _as_adapter(self, routed: RouteRequest) -> RouteRequest:
        """The request with the base model of the LoRA adapter its `model` names (and whether this
        router can load it onto workers of that base), its prefix blocks apart from the base
        model's (an adapter's KV is its own). Call it only for a model that is no known base model."""
        model = routed.model
        source = await self.lora.find(model) if self.lora is not None else None
        base = source.base if source is not None else self.membership.adapter_base(model)
        if base is None:
            return routed
        blocks = salted_blocks(routed.prefix_blocks, model)
        return replace(routed, adapter_of=base, adapter_loadable=source is not None, prefix_blocks=blocks)

    def _serves(self, model: str) -> bool:
        """Whether a model, or one it falls back to, is configured or was seen on a worker (a LoRA
        adapter: is held by a worker now, or in this router's catalog)."""
        known, configured = self.membership.known_models, self.config.models

        def seen(name: str) -> bool:  # the workers are looked over only for a name not known
            catalogued = self.lora is not None and name in self.lora.sources
            return name in known or name in configured or catalogued or name in self.membership.models()

        return seen(model) or any(seen(m) for m in self.fallbacks(model))

    def fallbacks(self, model: str) -> list[str]:
        settings = self.config.models.get(model)
        return list(settings.fallbacks) if settings else []

    async def handle(self, request: Request, path: str, chat: bool, around: Around | None = None) -> Response:
        """Serves a client's own completion request; `around`, when given, serves the parsed body
        itself through the dispatch it is handed (to keep what it answers, say)."""
        headers = header_dict(request)
        read = await self.read(request, headers)
        if isinstance(read, Response):
            RequestTelemetry(self.tracing, self.metrics, headers, path, self.events).finish(read.status_code)
            return read
        client, body = read

        async def dispatch(body: object) -> Response:
            return await self.dispatch(body, headers, path, chat, client, resumable=True)

        return await dispatch(body) if around is None else await around(body, client, dispatch)

    def client(self, headers: Mapping[str, str]) -> Client | Response:
        """The client a request's API key names, or the 401 to answer."""
        client = self.api_keys.authenticate(authorization(headers))
        if client is None:
            return error_response(
                401,
                "a valid API key is required (Authorization: Bearer KEY, or x-api-key: KEY)",
                "authentication_error",
            )
        return client

    async def read(self, request: Request, headers: Mapping[str, str]) -> Response | tuple[Client, object]:
        """Authenticates and parses a client request: (client, JSON body), or the error to answer."""
        client = self.client(headers)
        if isinstance(client, Response):
            return client
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.config.max_body_bytes:
            return self._too_large()
        raw = await body_within(request.receive, self.config.max_body_bytes)
        if raw is None:
            return self._too_large()
        try:
            return client, msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            return error_response(400, f"invalid request: {exc}", "invalid_request_error")

    async def dispatch(
        self,
        body: object,
        headers: Mapping[str, str],
        path: str,
        chat: bool,
        client: Client,
        resumable: bool = False,
    ) -> Response:
        """Routes one parsed OpenAI request body from an authenticated client (also the entry point
        of APIs built on completions, such as /v1/responses), traced and counted: a streamed
        response's telemetry ends with its stream, any other's here. A `resumable` request (a
        client's own completion) is journaled when the router keeps a stream journal, and one that
        names a `Last-Event-ID` continues that stream instead of starting one."""
        telemetry = RequestTelemetry(self.tracing, self.metrics, headers, path, self.events)
        resume = None
        if resumable and "last-event-id" in headers:
            try:
                resume = await self._resumed(headers["last-event-id"], path, client)
                body = resume[1].body  # the request as first sent, whatever this one says
            except ResumeRefused as refused:
                response = error_response(refused.status, str(refused), _ERROR_TYPES[refused.status], "Last-Event-ID")
                telemetry.finish(response.status_code)
                return response
        try:
            if not isinstance(body, dict):
                raise RequestError("the body must be a JSON object")
            routed = (
                embedding_route_request(body, headers, self.config.chars_per_token)
                if path == EMBEDDINGS_PATH
                else route_request(body, headers, chat, self.config.chars_per_token, self.config.default_decode_tokens)
            )
        except RequestError as exc:
            response = error_response(400, f"invalid request: {exc}", "invalid_request_error", exc.param)
        else:
            request = RequestContext(routed, body, path, headers, chat, client, telemetry)
            response = await self._dispatch(request, resumable, resume)
        if not isinstance(response, StreamingResponse):
            telemetry.finish(response.status_code)
        return response

    async def _dispatch(
        self, request: RequestContext, resumable: bool, resume: tuple[EventId, Journaled] | None
    ) -> Response:
        """Admits, places and forwards a parsed request (`resume`: where the client of a resumed
        stream stands, and its journaled request)."""
        headers, client, telemetry = request.headers, request.client, request.telemetry
        if request.routed.model not in self.membership.known_models and request.routed.model not in self.config.models:
            request.routed = await self._as_adapter(request.routed)
        if not self._serves(request.routed.model):  # counted as model "unknown": clients do not name labels
            return error_response(
                404, f"model {request.routed.model!r} is not served by this cluster", "not_found_error", "model"
            )
        settings = self.config.models.get(request.routed.model)
        defaults = (client.targets, settings.targets) if settings else (client.targets,)
        targeted = TTFT_HEADER in headers or TPOT_HEADER in headers or any(d.given for d in defaults)
        if targeted:
            try:
                request.routed = with_targets(request.routed, headers, *defaults)
            except BadTarget as exc:
                return error_response(400, f"invalid request: {exc}", "invalid_request_error", exc.header)
        telemetry.routed_as(request.routed, request.body.get("stream") is True)
        refusal = late(request.routed, self.balancer.best_estimate)
        if refusal is not None:
            return error_response(
                429, refusal, "rate_limit_error", headers={"retry-after": str(self.config.admission.retry_after_s)}
            )
        try:
            deadline_s = _deadline(headers, self.config.admission.queue_timeout_s)
        except RequestError as exc:
            return error_response(400, f"invalid request: {exc}", "invalid_request_error", exc.param)
        end_user = request.routed.end_user
        wait = self.rate_limiter.check(client.limits(end_user), request.routed.total_tokens)
        if wait:
            return error_response(
                429,
                f"rate limit exceeded for {client.name}" + (f" or its end user {end_user}" if end_user else ""),
                "rate_limit_error",
                headers={"retry-after": str(math.ceil(wait)) if math.isfinite(wait) else "60"},
            )
        degraded = None
        if (
            request.routed.priority == "sheddable"
            and request.path != EMBEDDINGS_PATH
            and not self.admission.has_room(request.routed.model)
        ):
            request.routed, request.body, degraded = self._degrade(request.routed, request.body)
        if self.capacity(request.routed.model) == 0 and request.routed.model in self.membership.known_models:
            # Its workers are gone: wait a little for one to return. A model whose first workers
            # are still starting waits for them as long as the request's deadline allows.
            deadline_s = min(deadline_s, self.config.failover.wait_for_capacity_s)
        try:
            share = Share(client.tenant(end_user), request.routed.total_tokens, client.weight)
            if not self.admission.try_admit(request.routed.model, request.routed.priority, share):
                await self._wait_for_admission(request, deadline_s, share)
        except Refused as refused:
            fallback = next((m for m in self.fallbacks(request.routed.model) if self.admission.has_room(m)), None)
            if refused.status != 503 or fallback is None:
                return error_response(
                    refused.status,
                    str(refused),
                    "rate_limit_error" if refused.status == 429 else "service_unavailable",
                    headers={"retry-after": str(refused.retry_after_s)},
                )
            request.routed, request.body, degraded = (
                replace(request.routed, model=fallback),
                {**request.body, "model": fallback},
                f"fallback={fallback}",
            )
            self.admission.slots.take(fallback)
        if degraded:
            telemetry.root.set_attribute("shoal.degraded", degraded)
        routed, body = request.routed, request.body  # as admitted: fixed from here on
        started_ns = time.time_ns()
        placement = self.balancer.place(routed)
        telemetry.placed(routed, placement, self.balancer.policy.name, started_ns)
        if placement is None:
            self.admission.release(routed.model)
            return error_response(
                503,
                f"no worker can take this request for {routed.model!r} now",
                "service_unavailable",
                headers={"retry-after": str(self.config.admission.retry_after_s)},
            )
        model = routed.model
        request.extra_headers = {
            "x-shoal-router": self.router_id,
            "x-shoal-trace-id": telemetry.trace_id,
            "x-request-id": telemetry.request_id,
            **({"x-shoal-degraded": degraded} if degraded else {}),
        }

        def release_slot() -> None:
            self.admission.release(model)

        request.wait_s = min(_deadline(headers, math.inf), self.config.failover.wait_for_capacity_s)
        if self.journal is not None and resumable and body.get("stream") is True and body.get("n", 1) == 1:
            request.journal = self.journal.writer(request.path, body, client.name)
        progress = None
        if resume is not None:
            try:
                progress = await self._resume_progress(request, *resume)
            except StreamBroken as broken:
                self.balancer.release(placement)
                release_slot()
                return error_response(503, f"the stream cannot be resumed now: {broken}", "service_unavailable")
            if request.journal is not None:
                request.journal.resumed_at(len(resume[1].token_ids))
        if request.path == EMBEDDINGS_PATH:
            return await self.failover.serve_whole(request, placement, release_slot)
        return await self.failover.serve(request, placement, release_slot, progress)

    async def _resumed(self, last_event_id: str, path: str, client: Client) -> tuple[EventId, Journaled]:
        """Where the client of a Last-Event-ID stands, and its journaled request; ResumeRefused
        when there is none to resume here."""
        if self.journal is None:
            raise ResumeRefused(400, "this router keeps no stream journal (resumable_streams.store is none)")
        position = EventId.parse(last_event_id)
        journaled = await self.journal.read(position.response_id, client.name)
        if journaled.path != path:
            raise ResumeRefused(400, f"stream {position.response_id!r} was a request to {journaled.path}")
        return position, journaled

    async def _resume_progress(
        self, request: RequestContext, position: EventId, journaled: Journaled
    ) -> StreamProgress:
        """The progress of a resumed stream: exactly what its client had been sent (the journal may
        hold less: the rest is regenerated first)."""
        progress = StreamProgress(
            token_ids=journaled.token_ids[: position.tokens],
            opened=True,
            text_chars=journaled.text_chars,
            seed=journaled.seed,
            response_id=position.response_id,
        )
        if position.tokens > len(journaled.token_ids):
            await self.failover.catch_up(request, progress, position.tokens)
        progress.text_chars = position.chars
        return progress

    async def _wait_for_admission(self, request: RequestContext, deadline_s: float, share: Share) -> None:
        """Queues for a slot, as a `router.admission` span (a request admitted at once has none)."""
        routed = request.routed
        span = request.telemetry.span(
            "router.admission", **{"shoal.model": routed.model, "shoal.priority": routed.priority}
        )
        try:
            await self.admission.admit(routed.model, routed.priority, deadline_s, share)
        except Refused as refused:
            span.set_attribute("shoal.refused", refused.status)
            raise
        finally:
            span.end()

    def _degrade(self, routed: RouteRequest, body: dict) -> tuple[RouteRequest, dict, str | None]:
        """A sheddable request under saturation: the first fallback model with room, else a shorter
        output. Returns the new request, body and what was done (for the x-shoal-degraded header)."""
        for fallback in self.fallbacks(routed.model):
            if self.admission.has_room(fallback):
                return replace(routed, model=fallback), {**body, "model": fallback}, f"fallback={fallback}"
        cap = self.config.admission.degrade_max_tokens
        if cap and routed.expected_decode_tokens > cap:
            capped = {**body, "max_tokens": cap}
            capped.pop("max_completion_tokens", None)
            return replace(routed, expected_decode_tokens=cap), capped, f"max_tokens={cap}"
        return routed, body, None

    def _too_large(self) -> Response:
        return error_response(413, f"request body exceeds {self.config.max_body_bytes} bytes", "invalid_request_error")


def header_dict(request: Request) -> dict[str, str]:
    """A request's headers as a dict, for the dozen lookups on a request's way (Starlette's Headers
    scan a list each time). Names are lower case (ASGI); of a repeated header the first counts, as
    with Starlette's get()."""
    return {name.decode("latin-1"): value.decode("latin-1") for name, value in reversed(request.scope["headers"])}


# Serves a parsed request body from a client through the dispatch it is given (FrontDoor.handle).
Around = Callable[[object, Client, Callable[[object], Awaitable[Response]]], Awaitable[Response]]
_ERROR_TYPES = {400: "invalid_request_error", 404: "not_found_error", 503: "service_unavailable"}


def _deadline(headers: Mapping[str, str], default_s: float) -> float:
    """The most seconds the client lets the request wait for capacity: x-shoal-deadline-s, at most
    the configured queue timeout."""
    raw = headers.get("x-shoal-deadline-s")
    if raw is None:
        return default_s
    try:
        seconds = float(raw)
    except ValueError:
        seconds = math.nan
    if not (seconds >= 0 and math.isfinite(seconds)):
        raise RequestError("x-shoal-deadline-s must be a non-negative number of seconds", "x-shoal-deadline-s")
    return min(seconds, default_s)
