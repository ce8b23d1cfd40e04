"""`shoal serve`: the router (in this process) and its workers (supervised subprocesses) from one
deployment config. The supervisor puts each worker into the router once it is ready and takes it
out when it exits; Ctrl-C (or SIGTERM) stops the router and drains the workers. Operators restart a
model's replicas one by one with `POST /admin/models/{model}/restart` (admin token; `shoal restart`).

The run's facts go to STATE_DIR/serve/: serve.json (the endpoint, the admin token, this process)
for `shoal status`, workers.json (the supervisor's view), logs/ (one file per worker). What the
supervisor and the autoscaler do goes to the router's event feed, and the router's dashboard shows
the supervisor's replica slots beside its workers.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import secrets
import signal
from pathlib import Path

import uvicorn
from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from shoal.cluster.autoscaler import Autoscaler
from shoal.cluster.config import DeploymentConfig
from shoal.cluster.launcher_local import LocalLauncher
from shoal.cluster.supervisor import Launcher, RouterLink, Supervisor
from shoal.protocol.cluster_secret import run_secret
from shoal.router.app import create_router_app
from shoal.router.fleet.membership import normalize_url
from shoal.router.front_door import FrontDoor
from shoal.router.streams.proxy import error_response

log = logging.getLogger(__name__)


class ServeServer(uvicorn.Server):
    """uvicorn whose Ctrl-C / SIGTERM ends serve() and is not raised again afterwards (uvicorn
    re-raises it, which would cut short the workers' drain that follows)."""

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True


def run_dir(state_dir: str) -> Path:
    return Path(state_dir).expanduser() / "serve"


def serve(config: DeploymentConfig) -> int:
    directory = run_dir(config.state_dir)
    directory.mkdir(parents=True, exist_ok=True)
    router_config = config.router_config()
    if "state" not in config.router.model_fields_set:  # conversations and batches live with the deployment's state
        state_dir = Path(config.state_dir).expanduser()
        state = router_config.state.model_copy(
            update={"sqlite_path": str(state_dir / "state.sqlite3"), "files_dir": str(state_dir / "files")}
        )
        router_config = router_config.model_copy(update={"state": state})
    admin_token = os.environ.get(router_config.admin_token_env) or secrets.token_hex(16)
    os.environ[router_config.admin_token_env] = admin_token
    app = create_router_app(router_config)
    server = ServeServer(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning"))
    connect_host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    url = f"http://{connect_host}:{config.port}"
    supervisor = Supervisor(
        _launcher(config, directory / "logs"),
        config.models,
        config.supervisor,
        _router_link(app.state.front_door),
        directory / "workers.json",
    )
    app.include_router(_admin_routes(supervisor, admin_token))
    app.state.dashboard.replicas = lambda: [slot.describe() for slot in supervisor.slots]
    descriptor = os.open(directory / "serve.json", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)  # holds the token
    with os.fdopen(descriptor, "w") as facts:
        json.dump({"url": url, "admin_token": admin_token, "pid": os.getpid()}, facts)
    try:
        asyncio.run(_run(server, supervisor, app, url, config))
    finally:
        (directory / "serve.json").unlink(missing_ok=True)
    return 0


def _launcher(config: DeploymentConfig, log_dir: Path) -> Launcher:
    if config.launcher == "ray":
        from shoal.cluster.launcher_ray import RayLauncher

        return RayLauncher(config.ray_address, log_dir)
    return LocalLauncher(log_dir, run_secret())


def _router_link(front_door: FrontDoor) -> RouterLink:
    async def join(url: str, model: str) -> None:
        await front_door.membership.add_static(url, [model])
        front_door.admission.wake()

    def leave(url: str) -> None:
        if front_door.membership.remove(url) is not None:
            front_door.balancer.forget(normalize_url(url))

    return RouterLink(join, leave, front_door.events.record)


def _admin_routes(supervisor: Supervisor, admin_token: str) -> APIRouter:
    routes = APIRouter()

    @routes.post("/admin/models/{model}/restart")
    async def rolling_restart(model: str, request: Request) -> Response:
        """Replaces the model's replicas one at a time, without dropping requests."""
        offered = request.headers.get("authorization", "").removeprefix("Bearer ")
        if not hmac.compare_digest(offered.encode(), admin_token.encode()):
            return error_response(401, "a valid admin token is required", "authentication_error")
        if model not in {slot.deployment.name for slot in supervisor.slots}:
            return error_response(404, f"no model {model!r} in this deployment", "not_found_error")
        return JSONResponse({"model": model, "replaced": await supervisor.rolling_restart(model)})

    return routes


async def _run(server: ServeServer, supervisor: Supervisor, app, url: str, config: DeploymentConfig) -> None:
    serving = asyncio.create_task(server.serve())  # until Ctrl-C or SIGTERM
    while not server.started and not serving.done():
        await asyncio.sleep(0.05)
    tasks = [asyncio.create_task(supervisor.run()), asyncio.create_task(_announce_when_ready(app, url, config))]
    if any(m.autoscaling for m in config.models):
        tasks.append(asyncio.create_task(Autoscaler(config.models, supervisor, app.state.front_door).run()))
    try:
        await serving
    finally:
        for task in tasks:
            task.cancel()
        print("shoal: stopping: draining the workers", flush=True)
        await supervisor.stop()


async def _announce_when_ready(app, url: str, config: DeploymentConfig) -> None:
    """Says `ready` once every replica serves in the router (so its /ready holds too); requests
    sent before that wait for the first workers."""
    models = ", ".join(m.describe() for m in config.models)
    wanted = sum(m.replicas for m in config.models)
    print(f"shoal: starting {wanted} workers ({models}) behind {url}; requests wait for them", flush=True)
    membership = app.state.front_door.membership
    while sum(1 for w in membership.workers.values() if w.available) < wanted:
        await asyncio.sleep(0.2)
    print(
        f"shoal: ready: {wanted} workers serving; OpenAI endpoint {url}/v1 ({models}); `shoal status` shows "
        f"the cluster; Ctrl-C stops",
        flush=True,
    )
    print(
        f"shoal: dashboard {url}/dashboard (sign in with the admin token in "
        f"{run_dir(config.state_dir) / 'serve.json'})",
        flush=True,
    )
