"""The local launcher: each worker a `shoal worker` subprocess on this host (the supervisor adds it
to the router once it is ready). Workers run in their own session, so a Ctrl-C in the terminal
reaches `shoal serve` only, which then drains them; each writes its log to its own file."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from shoal.cluster.config import ModelDeployment
from shoal.processes import free_port
from shoal.protocol.cluster_secret import child_environment


@dataclass
class LaunchedWorker:
    """A started worker. `process` is a subprocess.Popen, or anything with its poll, pid,
    returncode, send_signal, kill and wait (a worker on another machine); `node` names the host
    where the launcher knows it, `stage_nodes` those of its pipeline stages."""

    process: subprocess.Popen
    url: str
    log_path: Path
    node: str | None = None
    stage_nodes: tuple[str, ...] = ()


class LocalLauncher:
    """Its workers share the cluster `secret` (their KV peers speak to holders of it only)."""

    def __init__(self, log_dir: Path, secret: str, host: str = "127.0.0.1"):
        self.log_dir = log_dir
        self.secret = secret
        self.host = host

    def start(self, deployment: ModelDeployment, slot: int) -> LaunchedWorker:
        port = free_port(self.host)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / deployment.log_name(slot)
        with open(log_path, "ab") as log:
            process = subprocess.Popen(
                worker_command(deployment, self.host, port),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=child_environment(self.secret),
            )
        return LaunchedWorker(process, f"http://{self.host}:{port}", log_path)


def worker_command(
    deployment: ModelDeployment, host: str, port: int, stage_addresses: tuple[str, ...] = ()
) -> list[str]:
    """The `shoal worker` command line of one replica of `deployment`: its engine config whole, as
    JSON; its pipeline stages are the deployment's stage servers, else `stage_addresses`, else local
    processes it starts."""
    return [
        sys.executable,
        "-m",
        "shoal.cli",
        "worker",
        "--engine-config",
        deployment.engine_config(stage_addresses).to_json(),
        "--served-model-name",
        deployment.name,
        "--host",
        host,
        "--port",
        str(port),
        "--drain-grace-s",
        str(deployment.drain_grace_s),
        "--role",
        deployment.role,
    ]
