"""The harsh chaos scenario's fleet and fault injector: `shoal serve` supervises the workers, and
every few seconds a random one of them is killed, frozen or restarted, whatever the others' state,
so that at times every worker is down at once. Used by chaos.py --scenario harsh."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from routing_quality import free_port, wait_for


class ServedFleet:
    """`shoal serve` with one model of `args.workers` replicas; its output goes to
    LOG_DIR/router.log (the router's log lines included), its state to LOG_DIR/state."""

    def __init__(self, args, model: str, model_name: str, log_dir: Path):
        self.args, self.model, self.model_name, self.log_dir = args, model, model_name, log_dir
        self.state_dir = log_dir / "state"
        self.process: subprocess.Popen | None = None
        self.router_url = ""
        self.admin_token = ""

    def start(self) -> None:
        args = self.args
        port = free_port()
        config = {
            "port": port,
            "state_dir": str(self.state_dir),
            "models": [
                {
                    "name": self.model_name,
                    "model": self.model,
                    "replicas": args.workers,
                    "dtype": args.dtype,
                    "kv_cache": args.kv_cache,
                    "num_threads": args.threads_per_worker,
                    "step_delay_ms": args.step_delay_ms,
                    "drain_grace_s": args.drain_grace_s,
                }
            ],
            "router": {
                "health": {"heartbeat_interval_s": args.heartbeat_interval_s},
                "failover": {
                    "token_deadline_min_s": args.token_deadline_min_s,
                    "wait_for_capacity_s": args.wait_for_capacity_s,
                },
            },
        }
        config_path = self.log_dir / "serve.yaml"
        config_path.write_text(yaml.safe_dump(config))
        with open(self.log_dir / "router.log", "a") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "shoal.cli", "serve", "--config", str(config_path)],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.router_url = f"http://127.0.0.1:{port}"
        wait_for(self.router_url + "/ready", self.process, timeout_s=600)
        self.admin_token = json.loads((self.state_dir / "serve" / "serve.json").read_text())["admin_token"]

    def slots(self) -> list[dict]:
        """The supervisor's view: one entry per replica slot (pid, url, state, restarts)."""
        path = self.state_dir / "serve" / "workers.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):  # being rewritten
            return []

    def close(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        for slot in self.slots():  # a frozen worker could not drain
            if slot["pid"]:
                try:
                    os.kill(slot["pid"], signal.SIGCONT)
                except ProcessLookupError:
                    pass
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


class HarshInjector:
    """Every `args.fault_interval_s` (jittered by a quarter) a random live worker process gets a
    random fault: kill (SIGKILL), stop (a freeze: SIGSTOP for 2-6 s, then SIGCONT) or restart (SIGTERM, which
    drains). Nothing waits for the fleet to recover; the supervisor restarts what exits."""

    KINDS = ("kill", "stop", "restart")

    def __init__(self, fleet: ServedFleet, watch, args, open_streams: dict):
        self.fleet, self.watch, self.args, self.open_streams = fleet, watch, args, open_streams
        self.phase_started_wall = time.time()
        self.rng = random.Random(args.seed)
        self.faults: list[dict] = []
        self.thawing: set[asyncio.Task] = set()
        self.planned = None  # not planned: one every fault_interval_s until the phase ends

    def _alive(self) -> list[dict]:
        alive = []
        for slot in self.fleet.slots():
            if slot["pid"]:
                try:
                    os.kill(slot["pid"], 0)
                except ProcessLookupError:
                    continue
                alive.append(slot)
        return alive

    async def _thaw(self, pid: int, after_s: float) -> None:
        await asyncio.sleep(after_s)
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass

    def inject(self) -> dict | None:
        alive = self._alive()
        if not alive:
            return None
        slot, kind = self.rng.choice(alive), self.rng.choice(self.KINDS)
        url = slot["url"]
        fault = {
            "kind": kind,
            "worker": url,
            "slot": slot["slot"],
            "slot_state": slot["state"],
            "pid": slot["pid"],
            "router_in_flight": self.watch.workers.get(url, {}).get("in_flight", 0),
            "client_streams_opened_there": sorted(i for i, w in self.open_streams.items() if w == url),
            "healthy_there_before": bool(self.watch.workers.get(url, {}).get("healthy")),
            "healthy_workers_before": sum(w.get("healthy", False) for w in self.watch.workers.values()),
            "injected_at": time.time(),
        }
        if kind == "kill":
            os.kill(slot["pid"], signal.SIGKILL)
        elif kind == "stop":
            os.kill(slot["pid"], signal.SIGSTOP)
            fault["frozen_s"] = self.rng.uniform(2.0, 6.0)
            task = asyncio.create_task(self._thaw(slot["pid"], fault["frozen_s"]))
            self.thawing.add(task)
            task.add_done_callback(self.thawing.discard)
        else:
            os.kill(slot["pid"], signal.SIGTERM)
        fault["offset_s"] = fault["injected_at"] - self.phase_started_wall
        return fault

    async def run(self, finished: asyncio.Event) -> None:
        started = time.monotonic()
        next_at = self.args.fault_interval_s
        while not finished.is_set():
            if time.monotonic() - started < next_at:
                await asyncio.sleep(0.05)
                continue
            next_at += self.args.fault_interval_s * self.rng.uniform(0.75, 1.25)
            fault = self.inject()
            if fault is None:
                continue
            self.faults.append(fault)
            print(
                f"  fault {len(self.faults)}: {fault['kind']} {fault['worker']} ({fault['slot_state']}) at "
                f"{fault['offset_s']:.1f} s, {fault['healthy_workers_before']} healthy before",
                flush=True,
            )
        await asyncio.gather(*self.thawing)
