"""The network chaos scenario's fleet and fault injector: a router, the workers and Redis each on a
host of a test bed of network namespaces (tests/support/testbed.py); the client load runs on the
machine itself. Faults come one at a time, each held for --fault-hold-s and then healed: a link cut,
a blackhole, a one-way partition (the router's packets to the worker dropped, its heartbeats
passing) and a slow link on a worker with streams in flight, then Redis out of reach (probed with
stored Responses API requests meanwhile). Used by chaos.py --scenario network."""

from __future__ import annotations

import asyncio
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml
from routing_quality import wait_for

from tests.support.redis_server import start_redis_server
from tests.support.testbed import NetworkBed

ROUTER_PORT, WORKER_PORT = 8000, 8001
KINDS = ("cut", "blackhole", "one-way", "slow", "redis")


class NetworkFleet:
    """Router, workers and Redis on hosts "router", "w0".."wN-1" and "redis"; logs in LOG_DIR."""

    def __init__(self, args, model: str, model_name: str, log_dir: Path):
        self.args, self.model, self.model_name, self.log_dir = args, model, model_name, log_dir
        self.bed = NetworkBed(["router", *(f"w{k}" for k in range(args.workers)), "redis"])
        self.admin_token = secrets.token_hex(16)
        self.router_url = ""
        self.workers: dict[str, str] = {}  # worker URL -> host name
        self.redis_url = ""

    def start(self) -> None:
        args, bed = self.args, self.bed.up()
        _, self.redis_url = start_redis_server(self.log_dir, host=bed["redis"])
        router = bed["router"]
        config = {
            "host": router.address,
            "port": ROUTER_PORT,
            "health": {"heartbeat_interval_s": args.heartbeat_interval_s},
            "failover": {
                "token_deadline_min_s": args.token_deadline_min_s,
                "wait_for_capacity_s": args.wait_for_capacity_s,
            },
            "state": {"store": "redis", "redis_url": self.redis_url},
        }
        (self.log_dir / "router.yaml").write_text(yaml.safe_dump(config))
        secret = secrets.token_hex(16)
        env = {**os.environ, "SHOAL_CLUSTER_SECRET": secret, "SHOAL_ADMIN_TOKEN": self.admin_token}
        with open(self.log_dir / "router.log", "a") as log:
            process = router.popen(
                [sys.executable, "-m", "shoal.cli", "router", "--config", str(self.log_dir / "router.yaml")],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        self.router_url = router.url(ROUTER_PORT)
        wait_for(self.router_url + "/health", process, timeout_s=60)
        for k in range(args.workers):
            host = bed[f"w{k}"]
            command = [
                sys.executable, "-m", "shoal.cli", "worker",
                "--model", self.model, "--served-model-name", self.model_name,
                "--host", host.address, "--port", str(WORKER_PORT), "--router", self.router_url,
                "--kv-cache", args.kv_cache, "--num-threads", str(args.threads_per_worker),
                "--step-delay-ms", str(args.step_delay_ms), "--dtype", args.dtype,
            ]  # fmt: skip
            with open(self.log_dir / f"worker-{k}.log", "a") as log:
                host.popen(command, env=env, stdout=subprocess.DEVNULL, stderr=log)
            self.workers[host.url(WORKER_PORT)] = host.name
        deadline = time.monotonic() + 600
        while len(self.healthy()) < args.workers:
            if time.monotonic() > deadline:
                raise RuntimeError("the workers did not all register")
            time.sleep(0.5)
        wait_for(self.router_url + "/ready", process, timeout_s=60)

    def healthy(self) -> set[str]:
        try:
            body = httpx.get(
                self.router_url + "/admin/workers",
                headers={"authorization": f"Bearer {self.admin_token}"},
                timeout=5,
            ).json()
        except (httpx.HTTPError, ValueError):
            return set()
        return {w["worker_id"] for w in body["workers"] if w["healthy"]}

    def close(self) -> None:
        self.bed.down()


class NetworkInjector:
    """One fault of each kind in KINDS order, each on a worker with streams in flight (Redis for the
    last), held for args.fault_hold_s, then healed; the next waits until every worker is healthy."""

    def __init__(self, fleet: NetworkFleet, watch, args, open_streams: dict):
        self.fleet, self.watch, self.args, self.open_streams = fleet, watch, args, open_streams
        self.phase_started_wall = time.time()
        self.faults: list[dict] = []
        self.planned = list(KINDS)

    async def _busiest(self, finished: asyncio.Event) -> str | None:
        deadline = time.monotonic() + 5
        while not finished.is_set():
            busy = sorted((w.get("in_flight", 0), url) for url, w in self.watch.workers.items() if w.get("healthy"))
            if busy and (busy[-1][0] > 0 or time.monotonic() > deadline):
                return busy[-1][1]
            await asyncio.sleep(0.05)
        return None

    def _apply(self, kind: str, host) -> None:
        bed = self.fleet.bed
        if kind in ("cut", "redis"):
            host.cut()
        elif kind == "blackhole":
            host.blackhole()
        elif kind == "one-way":
            host.block(WORKER_PORT, bed["router"])
        else:
            host.slow(self.args.slow_rate)

    async def _probe_store(self, fault: dict, until: float) -> None:
        """Stored Responses API requests while Redis is out of reach: when the first 503 came."""
        body = {"model": self.fleet.model_name, "input": "probe", "max_output_tokens": 2}
        async with httpx.AsyncClient(timeout=30) as client:
            while time.monotonic() < until:
                sent = time.time()
                status = (await client.post(self.fleet.router_url + "/v1/responses", json=body)).status_code
                fault.setdefault("store_answers", []).append((round(sent - fault["injected_at"], 2), status))
                if status == 503 and "first_503_after_s" not in fault:
                    fault["first_503_after_s"] = time.time() - fault["injected_at"]
                await asyncio.sleep(0.5)

    async def run(self, finished: asyncio.Event) -> None:
        for kind in KINDS:
            if finished.is_set():
                break
            url = None if kind == "redis" else await self._busiest(finished)
            if kind != "redis" and url is None:
                break
            host = self.fleet.bed["redis" if kind == "redis" else self.fleet.workers[url]]
            async with httpx.AsyncClient() as client:
                await self.watch.refresh(client)
            fault = {
                "kind": kind,
                "worker": url or "redis",
                "router_in_flight": self.watch.workers.get(url, {}).get("in_flight", 0) if url else 0,
                "client_streams_opened_there": sorted(i for i, w in self.open_streams.items() if w == url),
                "healthy_there_before": url is not None,
                "injected_at": time.time(),
            }
            self._apply(kind, host)
            fault["offset_s"] = fault["injected_at"] - self.phase_started_wall
            print(f"  fault {len(self.faults) + 1}: {kind} {fault['worker']} at {fault['offset_s']:.1f} s", flush=True)
            until = time.monotonic() + self.args.fault_hold_s
            if kind == "redis":
                await self._probe_store(fault, until)
            while time.monotonic() < until:
                await asyncio.sleep(0.05)
            host.heal()
            fault["healed_at"] = time.time()
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and not all(
                self.watch.workers.get(worker, {}).get("healthy") for worker in self.fleet.workers
            ):
                await asyncio.sleep(0.1)
            fault["back_in_rotation_at"] = time.time() if url else None
            self.faults.append(fault)
