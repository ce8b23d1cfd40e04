"""The router's ASGI app: the OpenAI endpoints in front of the fleet (see front_door; responses_api
for /v1/responses, stored_completions for stored chat completions, files_api and batch_api for
files and batches), Anthropic's Messages API (messages_api for /v1/messages), health, and the
control endpoints: workers join and heartbeat with the cluster secret; operators list, drain and
remove workers with the admin token, and watch the cluster on the dashboard (/dashboard)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os

import aiohttp
from fastapi import FastAPI, Request
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.responses import JSONResponse, Response

from shoal.observability.cluster_events import ClusterEvents
from shoal.observability.trace_assembly import whole_trace
from shoal.observability.tracing import FASTAPI_TELEMETRY, Tracing
from shoal.protocol.worker_load import RegistrationAccepted, decode_heartbeat, decode_registration, encode
from shoal.router.admission.slots import GroupSlots
from shoal.router.batch_api.batch_object import KIND as BATCH_KIND
from shoal.router.batch_api.batch_runner import BatchRunner
from shoal.router.batch_api.endpoints import BatchesApi
from shoal.router.completion_endpoints import CompletionEndpoints, RouterApp
from shoal.router.config import RouterConfig
from shoal.router.dashboard import Dashboard
from shoal.router.files_api.endpoints import FilesApi
from shoal.router.files_api.file_store import FileStore
from shoal.router.fleet.health_events import HealthEvents
from shoal.router.fleet.health_monitor import HealthMonitor
from shoal.router.fleet.kv_event_feeds import KvEventFeeds
from shoal.router.fleet.membership import Membership
from shoal.router.fleet.worker_state import WorkerState
from shoal.router.front_door import FrontDoor
from shoal.router.group.bus import GroupBus
from shoal.router.group.sync import GroupMember, GroupSync
from shoal.router.header_limit import HeaderLimitMiddleware
from shoal.router.lora_admin import add_lora_admin_routes
from shoal.router.lora_catalog import LoraCatalog
from shoal.router.messages_api.endpoints import MessagesApi
from shoal.router.metrics import RouterMetrics, group_registry
from shoal.router.placement.balancer import Balancer
from shoal.router.placement.policies import make_policy
from shoal.router.placement.route_request import CHAT_PATH
from shoal.router.responses_api.background import KIND as BACKGROUND_KIND
from shoal.router.responses_api.endpoints import ResponsesApi
from shoal.router.state.leased_work import LeasedWork
from shoal.router.state.open_records import SharedRecords
from shoal.router.stored_completions.endpoints import StoredCompletions
from shoal.router.streams.proxy import error_response
from shoal.router.streams.upstream_client import UpstreamClient

log = logging.getLogger(__name__)


def _bearer_matches(request: Request, secret: str | None) -> bool:
    offered = request.headers.get("authorization", "").removeprefix("Bearer ")
    return bool(secret) and hmac.compare_digest(offered.encode(), secret.encode())


def _describe(state: WorkerState) -> dict:
    view = state.view()
    return {
        "worker_id": state.worker_id,
        "models": sorted(state.models),
        "engine": state.engine,
        "load_source": state.load_source,
        "healthy": state.available,
        "down": state.down,
        "ejected": state.ejected_until is not None,
        "breaker": str(state.breaker.state),
        "running": view.running,
        "waiting": view.waiting,
        "in_flight": view.in_flight,
        "outstanding_tokens": view.outstanding_tokens,
        "capability": view.capability,
        "decode_step_s": view.decode_step_s,
        "decode_step_noise": view.decode_step_noise,
        "decode_tokens_per_step": view.decode_tokens_per_step,
        "ttft_s": state.latency.ttft_s,
        "itl_s": state.latency.itl_s,
        "served_concurrency": view.served_concurrency,
        "service_s": view.service_s,
        "busy_s": view.busy_s,
    }


def create_router_app(config: RouterConfig, group: GroupMember | None = None) -> RouterApp:
    """Invariant: every response to a client is the worker's own or an OpenAI-shaped error. As a
    member of a router `group` it shares what it learns with the group's other members
    (group_sync) and admits against the group's slots."""
    registry = CollectorRegistry()
    feed = ClusterEvents()
    events = HealthEvents(registry, feed)
    membership = Membership(config.health, events, config.load_poll_interval_s)
    balancer = Balancer(make_policy(config.policy, **config.policy_options), membership, config.seed)
    monitor = HealthMonitor(membership, config.health, events, balancer.forget)
    tracing = Tracing(
        "shoal-router",
        config.tracing.otlp_endpoint,
        config.tracing.keep_traces,
        sample_ratio=config.tracing.sample_ratio,
        traces_per_second=config.tracing.traces_per_second,
    )
    metrics = RouterMetrics(registry)
    records = SharedRecords(config.state)
    cluster_secret = os.environ.get(config.cluster_secret_env)
    lora_catalog = LoraCatalog(records, membership, cluster_secret)
    kv_feeds = KvEventFeeds(lambda: {w: s.url for w, s in membership.workers.items()}, cluster_secret)
    if config.follow_kv_events:
        balancer.followed = kv_feeds.caches
    front_door = FrontDoor(
        config,
        membership,
        balancer,
        monitor,
        tracing,
        metrics,
        feed,
        slots=GroupSlots(group.slots_path, group.member, group.members) if group else None,
        router_id=f"{config.host}:{config.port}/{group.member}" if group else None,
        lora=lora_catalog,
    )
    sync = GroupSync(membership, balancer, front_door.admission) if group else None
    exposed = group_registry(group.metrics_directory) if group else registry
    metrics.watch(exposed, membership, front_door.admission.queued)
    responses_api = ResponsesApi(front_door, records)
    files = FileStore(records, config.state.files_dir, config.state.max_file_bytes)
    batches_api = BatchesApi(front_door, files, responses_api)
    batch_runner = BatchRunner(files, batches_api.serve_line, front_door.api_keys, config.batches)
    background_work = LeasedWork(
        records,
        BACKGROUND_KIND,
        responses_api.background.run_response,
        config.state.lease_s,
        config.state.work_poll_interval_s,
    )
    batch_work = LeasedWork(
        records, BATCH_KIND, batch_runner.run_batch, config.state.lease_s, config.state.work_poll_interval_s
    )
    admin_token = os.environ.get(config.admin_token_env)
    dashboard = Dashboard(membership, front_door.admission, tracing, metrics.window, feed)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(sock_connect=config.connect_timeout_s, sock_read=config.read_timeout_s),
        )
        membership.session = kv_feeds.session = session
        upstream = UpstreamClient(config.connect_timeout_s, config.read_timeout_s)
        front_door.open(upstream)
        await records.open()
        if sync is not None:
            sync.bus = GroupBus(
                group.directory, group.member, group.members, group.token, sync.apply, sync.gone, sync.snapshot
            )
            await sync.bus.start()
        for worker in config.workers:
            await membership.add_static(worker.url, worker.models)
        tasks = [
            asyncio.create_task(membership.run()),
            asyncio.create_task(monitor.run(capacity_grew=front_door.admission.wake)),
            asyncio.create_task(dashboard.run()),
            asyncio.create_task(batch_work.run()),
            asyncio.create_task(background_work.run()),
        ]
        if config.follow_kv_events:
            tasks.append(asyncio.create_task(kv_feeds.run()))
        yield
        for task in tasks:
            task.cancel()
        await batch_work.close()
        await background_work.close()
        await monitor.close()
        if sync is not None:
            await sync.bus.close()
        await records.close()
        await front_door.close()
        await upstream.close()
        await session.close()
        tracing.shutdown()

    app = RouterApp(title="shoal router", lifespan=lifespan, telemetry=FASTAPI_TELEMETRY)
    stored_completions = StoredCompletions(front_door, records)
    app.completions = CompletionEndpoints(front_door, config.max_header_bytes, {CHAT_PATH: stored_completions.around})
    app.add_middleware(HeaderLimitMiddleware, max_header_bytes=config.max_header_bytes)
    app.state.front_door = front_door
    app.state.tracing = tracing
    app.state.events = feed
    app.state.dashboard = dashboard
    app.include_router(responses_api.routes())
    app.include_router(stored_completions.routes())
    app.include_router(FilesApi(front_door, files).routes())
    app.include_router(batches_api.routes())
    app.include_router(MessagesApi(front_door).routes())
    app.include_router(dashboard.routes(authorized=lambda request: _bearer_matches(request, admin_token)))

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        """Ready when every configured model (else every model seen) has a serving worker; the
        body gives each model's count of serving workers."""
        serving = membership.serving_counts(set(config.models) or membership.known_models)
        is_ready = bool(serving) and all(serving.values())
        return JSONResponse({"ready": is_ready, "models": serving}, status_code=200 if is_ready else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(exposed), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        """Every model served, a LoRA adapter (catalogued, or served by a worker) with its base as parent."""
        data = []
        for name in sorted(membership.models() | set(lora_catalog.sources)):
            source = lora_catalog.sources.get(name)
            parent = source.base if source is not None else membership.adapter_base(name)
            card = {"id": name, "object": "model", "created": 0, "owned_by": "shoal"}
            data.append(card | {"parent": parent} if parent else card)
        return {"object": "list", "data": data}

    def unauthorized(what: str) -> Response:
        return error_response(401, f"a valid {what} is required", "authentication_error")

    @app.post("/admin/workers")
    async def register(request: Request) -> Response:
        """A worker joins with a Registration (protocol.worker_load; cluster secret)."""
        if not _bearer_matches(request, cluster_secret):
            return unauthorized("cluster secret")
        try:
            joining = decode_registration(await request.body())
        except ValueError as exc:
            return error_response(400, f"invalid registration: {exc}", "invalid_request_error")
        state = membership.register(joining.url, joining.models, joining.load)
        if sync is not None:
            sync.joined(joining.url, joining.models, joining.load)
        front_door.admission.wake()
        accepted = RegistrationAccepted(
            worker_id=state.worker_id,
            lease_s=config.health.lease_s,
            heartbeat_interval_s=config.health.heartbeat_interval_s,
        )
        return Response(encode(accepted), media_type="application/json")

    @app.post("/admin/workers/heartbeat")
    async def heartbeat(request: Request) -> Response:
        """A Heartbeat (protocol.worker_load; cluster secret); 404 tells a forgotten worker to register again."""
        if not _bearer_matches(request, cluster_secret):
            return unauthorized("cluster secret")
        try:
            beat = decode_heartbeat(await request.body())
        except ValueError as exc:
            return error_response(400, f"invalid heartbeat: {exc}", "invalid_request_error")
        if not membership.heartbeat(beat.worker_id, beat.load):
            return error_response(404, "unknown worker; register again", "not_found_error")
        if sync is not None:
            sync.beat(beat.worker_id, beat.load)
        return JSONResponse({"ok": True})

    @app.get("/admin/workers")
    async def list_workers(request: Request) -> Response:
        """The fleet as the router sees it: each worker's load and health, the admission queues and
        the latest health changes (admin token)."""
        if not _bearer_matches(request, admin_token):
            return unauthorized("admin token")
        return JSONResponse(
            {
                "queued": front_door.admission.queued(),
                "events": list(events.recent),
                "workers": [_describe(w) for w in membership.workers.values()],
            }
        )

    @app.get("/debug/traces")
    async def recent_requests(request: Request, limit: int = 50) -> Response:
        """The latest requests' root spans, newest first (admin token)."""
        if not _bearer_matches(request, admin_token):
            return unauthorized("admin token")
        return JSONResponse({"requests": tracing.recent.roots("router.request", max(1, min(limit, 500)))})

    @app.get("/debug/traces/{trace_id}")
    async def one_trace(trace_id: str, request: Request) -> Response:
        """Every span of a trace held here and on the workers it reached, in start order (admin token)."""
        if not _bearer_matches(request, admin_token):
            return unauthorized("admin token")
        return JSONResponse({"trace_id": trace_id, "spans": await whole_trace(tracing, membership.session, trace_id)})

    @app.delete("/admin/workers/{worker_id:path}")
    async def remove_worker(worker_id: str, request: Request) -> Response:
        """Stops routing to a worker (admin token); requests already there finish."""
        if not _bearer_matches(request, admin_token):
            return unauthorized("admin token")
        removed = membership.remove(worker_id)
        if removed is None:
            return error_response(404, f"no worker {worker_id!r}", "not_found_error")
        balancer.forget(removed.worker_id)
        if sync is not None:
            sync.left(removed.worker_id)
        log.info("worker %s removed by an operator", removed.worker_id)
        return JSONResponse({"removed": removed.worker_id})

    add_lora_admin_routes(
        app,
        membership,
        lora_catalog,
        lambda request: _bearer_matches(request, admin_token),
        cluster_secret,
        unauthorized,
    )
    return app
