"""`shoal serve`: the router (in this process) and its workers (supervised subprocesses) from one
deployment config. Workers register with the router by themselves; Ctrl-C (or SIGTERM) stops the
router and drains the workers.

The run's facts go to STATE_DIR/serve/: serve.json (the endpoint, the admin token, this process)
for `shoal status`, workers.json (the supervisor's view), logs/ (one file per worker).
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import signal
from pathlib import Path

import uvicorn

from shoal.cluster.config import DeploymentConfig
from shoal.cluster.launcher_local import LocalLauncher
from shoal.cluster.supervisor import Supervisor
from shoal.router.app import create_router_app
from shoal.router.config import ResponsesSettings

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
    if "responses" not in config.router.model_fields_set:  # conversations live with the deployment's state
        sqlite_path = str(Path(config.state_dir).expanduser() / "responses.sqlite3")
        router_config = router_config.model_copy(update={"responses": ResponsesSettings(sqlite_path=sqlite_path)})
    cluster_secret, admin_token = secrets.token_hex(16), secrets.token_hex(16)
    os.environ[router_config.cluster_secret_env] = cluster_secret
    os.environ[router_config.admin_token_env] = admin_token
    app = create_router_app(router_config)
    server = ServeServer(uvicorn.Config(app, host=config.host, port=config.port, log_level="warning"))
    connect_host = "127.0.0.1" if config.host in ("0.0.0.0", "::") else config.host
    url = f"http://{connect_host}:{config.port}"
    supervisor = Supervisor(LocalLauncher(url, cluster_secret, directory / "logs"), config.models,
                            config.supervisor, directory / "workers.json")
    (directory / "serve.json").write_text(json.dumps({"url": url, "admin_token": admin_token, "pid": os.getpid()}))
    (directory / "serve.json").chmod(0o600)
    try:
        asyncio.run(_run(server, supervisor, app, url, config))
    finally:
        (directory / "serve.json").unlink(missing_ok=True)
    return 0


async def _run(server: uvicorn.Server, supervisor: Supervisor, app, url: str, config: DeploymentConfig) -> None:
    supervising = asyncio.create_task(supervisor.run())
    announcing = asyncio.create_task(_announce_when_ready(app, url, config))
    try:
        await server.serve()  # until Ctrl-C or SIGTERM
    finally:
        announcing.cancel()
        supervising.cancel()
        print("shoal: stopping: draining the workers", flush=True)
        await supervisor.stop()


async def _announce_when_ready(app, url: str, config: DeploymentConfig) -> None:
    models = ", ".join(f"{m.name} ×{m.replicas}" for m in config.models)
    print(f"shoal: OpenAI endpoint {url}/v1 ({models}); `shoal status` shows the cluster; Ctrl-C stops",
          flush=True)
    membership = app.state.front_door.membership
    wanted = sum(m.replicas for m in config.models)
    while sum(1 for w in membership.workers.values() if w.available) < wanted:
        await asyncio.sleep(0.5)
    print(f"shoal: ready: {wanted} workers serving", flush=True)
