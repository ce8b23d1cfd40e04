"""The Ray launcher: each worker a `shoal worker` process started by a Ray actor on whichever node of
an existing Ray cluster has the replica's resources (CPUs, GPUs, custom resources that describe
heterogeneous nodes). The actor owns the process: the process dies with it (parent-death signal),
so a lost node or a killed actor is a worker exit, which the supervisor handles like any other.

Ray is an optional dependency (`pip install shoal[ray]`), imported only when this launcher is used.
"""
from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

import ray

from shoal.cluster.config import ModelDeployment
from shoal.cluster.launcher_local import LaunchedWorker, worker_command
from shoal.processes import die_with_parent

START_TIMEOUT_S = 120.0


@ray.remote(num_cpus=0, max_restarts=0)
class WorkerActor:
    """Runs one worker process on its node. Invariant: the process does not outlive the actor."""

    def start(self, deployment: ModelDeployment, log_dir: str, slot: int) -> tuple[int, str, str, str]:
        host = ray.util.get_node_ip_address()
        with socket.socket() as probe:
            probe.bind((host, 0))
            port = probe.getsockname()[1]
        log_path = Path(log_dir) / f"{deployment.name.replace('/', '_')}-{slot}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(worker_command(deployment, host, port), stdin=subprocess.DEVNULL,
                                            stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        return self.process.pid, f"http://{host}:{port}", str(log_path), ray.get_runtime_context().get_node_id()

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

    def start(self, deployment: ModelDeployment, slot: int) -> LaunchedWorker:
        """Blocks until Ray has placed the actor (call it off the event loop)."""
        resources = deployment.resources
        actor = WorkerActor.options(num_cpus=resources.cpus, num_gpus=resources.gpus,
                                    resources=dict(resources.custom)).remote()
        pid, url, log_path, node = ray.get(actor.start.remote(deployment, str(self.log_dir), slot),
                                           timeout=START_TIMEOUT_S)
        return LaunchedWorker(RemoteProcess(actor, pid), url, Path(log_path), node)
