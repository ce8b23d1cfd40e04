"""The Ray launcher: each worker a `shoal worker` process started by a Ray actor on whichever node of
an existing Ray cluster has the replica's resources (CPUs, GPUs, custom resources that describe
heterogeneous nodes); a pipeline replica's stages are `shoal stage` servers in actors of their
own, spread over the nodes that have the same resources (the head then measures them and plans).
An actor owns its process: the process dies with it (parent-death signal), so a lost node or a
killed actor is a worker exit, which the supervisor handles like any other. The launcher hands
every process it starts the cluster secret (the configured one, else one drawn for this run):
a worker and its stage servers link only to holders of it.

Ray is an optional dependency (`pip install shoal[ray]`), imported only when this launcher is used.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import ray

from shoal.cluster.config import ModelDeployment
from shoal.cluster.launcher_local import LaunchedWorker, worker_command
from shoal.config.environment import node_environment
from shoal.processes import die_with_parent
from shoal.protocol.cluster_secret import child_environment, run_secret

START_TIMEOUT_S = 120.0


def node_address() -> tuple[str, int]:
    """This Ray node's address and a free port on it."""
    host = ray.util.get_node_ip_address()
    with socket.socket() as probe:
        probe.bind((host, 0))
        return host, probe.getsockname()[1]


@ray.remote(num_cpus=0, max_restarts=0)
class StageActor:
    """Runs one pipeline stage server on its node. Invariant: the process does not outlive the actor."""

    def start(self, log_path: str, secret: str) -> tuple[str, str]:
        host, port = node_address()
        address = f"tcp://{host}:{port}"
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "shoal.parallel.pipeline_stage", "--bind", address],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_environment(secret),
                preexec_fn=die_with_parent,
            )
        return address, ray.get_runtime_context().get_node_id()


def actor_options(deployment: ModelDeployment) -> dict:
    """What each process of a replica asks Ray for: the deployment's resources, and the node
    variables set here (an instruction-set cap), which its processes inherit on whatever node."""
    resources = deployment.resources
    options = dict(num_cpus=resources.cpus, num_gpus=resources.gpus, resources=dict(resources.custom))
    if variables := node_environment(os.environ):
        options["runtime_env"] = {"env_vars": variables}
    return options


@ray.remote(num_cpus=0, max_restarts=0)
class WorkerActor:
    """Runs one worker process on its node, and the actors of its pipeline stages (on nodes Ray
    spreads them over) unless the deployment names stage servers. Invariants: the process does not
    outlive the actor; the stage actors belong to this actor, so they die with it."""

    def start(
        self, deployment: ModelDeployment, log_dir: str, slot: int, secret: str
    ) -> tuple[int, str, str, str, list[str]]:
        host, port = node_address()
        log_path = Path(log_dir) / deployment.log_name(slot)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        stages = []
        if deployment.pipeline_parallel_size > 1 and not deployment.stage_servers:
            self.stage_actors = [
                StageActor.options(**actor_options(deployment), scheduling_strategy="SPREAD").remote()
                for _ in range(deployment.pipeline_parallel_size - 1)
            ]
            stages = ray.get(
                [actor.start.remote(f"{log_path}.stage{i}", secret) for i, actor in enumerate(self.stage_actors, 1)]
            )
        with open(log_path, "ab") as log:
            command = worker_command(deployment, host, port, tuple(address for address, _ in stages))
            self.process = subprocess.Popen(
                command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=child_environment(secret),
                preexec_fn=die_with_parent,
            )
        return (
            self.process.pid,
            f"http://{host}:{port}",
            str(log_path),
            ray.get_runtime_context().get_node_id(),
            [node for _, node in stages],
        )

    def poll(self) -> int | None:
        return self.process.poll()

    def signal(self, sig: int) -> None:
        if self.process.poll() is None:
            self.process.send_signal(sig)


class RemoteProcess:
    """A worker process inside a Ray actor, seen through Popen's interface. poll() never blocks:
    it reads the answer to the previous question and asks again; a dead actor is an exit (-9)."""

    def __init__(self, actor, pid: int):
        self.actor = actor
        self.pid = pid
        self.returncode: int | None = None
        self.pending = actor.poll.remote()

    def poll(self) -> int | None:
        if self.returncode is None:
            ready, _ = ray.wait([self.pending], timeout=0)
            if ready:
                try:
                    self.returncode = ray.get(self.pending)
                except ray.exceptions.RayActorError:
                    self.returncode = -signal.SIGKILL
                if self.returncode is None:
                    self.pending = self.actor.poll.remote()
                else:  # release the actor's resources, and its stages
                    ray.kill(self.actor)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        self.actor.signal.remote(int(sig))

    def kill(self) -> None:
        ray.kill(self.actor)

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired("shoal worker", timeout)
            time.sleep(0.05)
        return self.returncode


class RayLauncher:
    """Connects to the Ray cluster at `address` ("auto": the one this host belongs to)."""

    def __init__(self, address: str, log_dir: Path):
        if not ray.is_initialized():
            ray.init(address=address, logging_level="WARNING", log_to_driver=False)
        self.log_dir = log_dir
        self.secret = run_secret()

    def start(self, deployment: ModelDeployment, slot: int) -> LaunchedWorker:
        """Blocks until Ray has placed the actor (call it off the event loop)."""
        actor = WorkerActor.options(**actor_options(deployment)).remote()
        try:
            pid, url, log_path, node, stage_nodes = ray.get(
                actor.start.remote(deployment, str(self.log_dir), slot, self.secret), timeout=START_TIMEOUT_S
            )
        except BaseException:
            ray.kill(actor)
            raise
        return LaunchedWorker(RemoteProcess(actor, pid), url, Path(log_path), node, tuple(stage_nodes))
