"""Keeps each model's replicas running: starts them, restarts crashed ones with exponential backoff,
and stops them all with a drain (SIGTERM, then the drain grace, then SIGKILL).

Its view of the workers is written to a JSON file after every change, for `shoal status`.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from shoal.cluster.config import ModelDeployment, SupervisorSettings
from shoal.cluster.launcher_local import LaunchedWorker, LocalLauncher

log = logging.getLogger(__name__)


@dataclass
class Slot:
    """One replica position. Invariant: `worker` is None exactly while the slot waits to (re)start,
    which happens at `next_start`."""

    deployment: ModelDeployment
    index: int
    backoff_s: float
    worker: LaunchedWorker | None = None
    started_at: float = 0.0
    next_start: float = 0.0
    restarts: int = 0
    last_exit: int | None = None

    def describe(self) -> dict:
        running = self.worker is not None
        return {"model": self.deployment.name, "slot": self.index, "state": "running" if running else "restarting",
                "pid": self.worker.process.pid if running else None, "url": self.worker.url if running else None,
                "log": str(self.worker.log_path) if running else None, "restarts": self.restarts,
                "last_exit": self.last_exit}


class Supervisor:
    def __init__(self, launcher: LocalLauncher, deployments: list[ModelDeployment], settings: SupervisorSettings,
                 status_path: Path):
        self.launcher = launcher
        self.settings = settings
        self.status_path = status_path
        self.slots = [Slot(d, i, settings.restart_backoff_s) for d in deployments for i in range(d.replicas)]

    def check(self, now: float) -> bool:
        """Starts what is due and notices exits; True when something changed."""
        changed = False
        for slot in self.slots:
            if slot.worker is None:
                if now >= slot.next_start:
                    slot.worker, slot.started_at = self.launcher.start(slot.deployment, slot.index), now
                    log.info("started %s replica %d at %s (pid %d)", slot.deployment.name, slot.index,
                             slot.worker.url, slot.worker.process.pid)
                    changed = True
                continue
            code = slot.worker.process.poll()
            if code is None:
                continue
            ran = now - slot.started_at
            if ran >= self.settings.healthy_after_s:
                slot.backoff_s = self.settings.restart_backoff_s
            log.warning("%s replica %d (pid %d) exited with %s after %.1f s; restarting in %.1f s",
                        slot.deployment.name, slot.index, slot.worker.process.pid, code, ran, slot.backoff_s)
            slot.worker, slot.last_exit, slot.restarts = None, code, slot.restarts + 1
            slot.next_start = now + slot.backoff_s
            slot.backoff_s = min(max(slot.backoff_s * 2, self.settings.restart_backoff_s),
                                 self.settings.max_restart_backoff_s)
            changed = True
        return changed

    def write_status(self) -> None:
        self.status_path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.status_path.with_suffix(".tmp")
        temporary.write_text(json.dumps([slot.describe() for slot in self.slots], indent=1))
        temporary.replace(self.status_path)

    async def run(self) -> None:
        self.write_status()
        while True:
            if self.check(time.monotonic()):
                self.write_status()
            await asyncio.sleep(0.2)

    async def stop(self) -> None:
        """Drains every worker: SIGTERM, then up to its drain grace (+5 s) to exit, then SIGKILL."""
        running = [slot for slot in self.slots if slot.worker is not None]
        for slot in running:
            slot.worker.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + max((s.deployment.drain_grace_s for s in running), default=0) + 5
        while any(s.worker.process.poll() is None for s in running) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for slot in running:
            if slot.worker.process.poll() is None:
                log.warning("%s replica %d did not drain in time; killed", slot.deployment.name, slot.index)
                slot.worker.process.kill()
                slot.worker.process.wait()
        self.status_path.unlink(missing_ok=True)
