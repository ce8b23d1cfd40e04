"""The router's ASGI app: the OpenAI endpoints in front of the fleet, plus health and the
membership endpoints workers use to join (authenticated with the cluster secret)."""
from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os

import httpx
from fastapi import FastAPI, Request
from starlette.responses import JSONResponse, Response

from shoal.router.balancer import Balancer
from shoal.router.config import RouterConfig
from shoal.router.membership import Membership
from shoal.router.policies import make_policy
from shoal.router.proxy import error_response, forward
from shoal.router.route_request import RequestError, route_request

log = logging.getLogger(__name__)


def create_router_app(config: RouterConfig) -> FastAPI:
    """Invariant: every response to a client is the worker's own or an OpenAI-shaped error."""
    client = httpx.AsyncClient(timeout=httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=512))
    membership = Membership(client, config.load_poll_interval_s, config.unhealthy_after_failures,
                            config.heartbeat_lease_s)
    balancer = Balancer(make_policy(config.policy, **config.policy_options), membership, config.seed)
    secret = os.environ.get(config.cluster_secret_env)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        for worker in config.workers:
            await membership.add_static(worker.url, worker.models)
        task = asyncio.create_task(membership.run())
        yield
        task.cancel()
        await client.aclose()

    app = FastAPI(title="shoal router", lifespan=lifespan)
    app.state.membership = membership
    app.state.balancer = balancer

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        serving = any(v.healthy for v in membership.views())
        return JSONResponse({"ready": serving}, status_code=200 if serving else 503)

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": m, "object": "model", "created": 0, "owned_by": "shoal"}
                                           for m in sorted(membership.models())]}

    async def proxy(request: Request, path: str, chat: bool) -> Response:
        raw = await request.body()
        if len(raw) > config.max_body_bytes:
            return error_response(413, f"request body exceeds {config.max_body_bytes} bytes", "invalid_request_error")
        try:
            body = json.loads(raw)
            if not isinstance(body, dict):
                raise RequestError("the body must be a JSON object")
            routed = route_request(body, dict(request.headers), chat, config.chars_per_token,
                                   config.default_decode_tokens)
        except ValueError as exc:  # JSONDecodeError and RequestError
            return error_response(400, f"invalid request: {exc}", "invalid_request_error", getattr(exc, "param", None))
        if routed.model not in membership.models():
            return error_response(404, f"model {routed.model!r} is not served by this cluster", "not_found_error",
                                  "model")
        placement = balancer.place(routed)
        if placement is None:
            return error_response(503, f"no worker can take this request for {routed.model!r} now",
                                  "service_unavailable", headers={"retry-after": "1"})
        return await forward(client, placement, path, raw, dict(request.headers), balancer.release)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy(request, "/v1/completions", chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await proxy(request, "/v1/chat/completions", chat=True)

    def authorized(request: Request) -> bool:
        offered = request.headers.get("authorization", "").removeprefix("Bearer ")
        return bool(secret) and hmac.compare_digest(offered.encode(), secret.encode())

    @app.post("/admin/workers")
    async def register(request: Request) -> Response:
        """A worker joins: {"url": ..., "models": [...], "load": {...}}."""
        if not authorized(request):
            return error_response(401, "a valid cluster secret is required", "authentication_error")
        try:
            body = await request.json()
            state = membership.register(str(body["url"]), [str(m) for m in body["models"]], body.get("load"))
        except (ValueError, KeyError, TypeError) as exc:
            return error_response(400, f"invalid registration: {exc}", "invalid_request_error")
        return JSONResponse({"worker_id": state.worker_id, "lease_s": config.heartbeat_lease_s})

    @app.post("/admin/workers/heartbeat")
    async def heartbeat(request: Request) -> Response:
        """{"worker_id": ..., "load": {...}}; 404 tells a forgotten worker to register again."""
        if not authorized(request):
            return error_response(401, "a valid cluster secret is required", "authentication_error")
        try:
            body = await request.json()
            known = membership.heartbeat(str(body["worker_id"]), body.get("load"))
        except (ValueError, KeyError, TypeError) as exc:
            return error_response(400, f"invalid heartbeat: {exc}", "invalid_request_error")
        if not known:
            return error_response(404, "unknown worker; register again", "not_found_error")
        return JSONResponse({"ok": True})

    @app.get("/admin/workers")
    async def list_workers(request: Request) -> Response:
        if not authorized(request):
            return error_response(401, "a valid cluster secret is required", "authentication_error")
        return JSONResponse({"workers": [
            {"worker_id": v.worker_id, "models": sorted(v.models), "healthy": v.healthy, "running": v.running,
             "waiting": v.waiting, "in_flight": v.in_flight, "outstanding_tokens": v.outstanding_tokens,
             "capability": v.capability} for v in membership.views()]})

    return app
