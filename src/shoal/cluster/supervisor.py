"""Keeps each model's replicas running: starts them, adds them to the router once ready, restarts
crashed ones with exponential backoff, keeps warm spares, replaces replicas one by one (rolling
restart), and stops them all with a drain (SIGTERM, then the drain grace, then SIGKILL).

A warm spare is a worker that has loaded and warmed up its model but is not in the router. When a
serving replica of its model exits, the spare joins the router at once (no model load on the
critical path) and the crashed slot comes back as the new spare. Its view of the workers is written
to a JSON file after every change, for `shoal status`; what happens to them (started, ready,
exited, promoted, scaled) goes to the router's event feed through the RouterLink.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Protocol

import httpx

from shoal.cluster.config import ModelDeployment, SupervisorSettings
from shoal.cluster.launcher_local import LaunchedWorker

log = logging.getLogger(__name__)


class SlotState(StrEnum):
    WAITING = "waiting"  # no process; (re)starts at next_start
    STARTING = "starting"  # process up, model loading
    SPARE = "spare"  # ready, not in the router
    SERVING = "serving"  # ready and in the router


@dataclass(eq=False)  # a slot is itself, whatever its fields say
class Slot:
    """One replica position. Invariants: `worker` is None in WAITING and while a STARTING slot's
    worker is being launched; a SERVING slot's worker is in the router, no other's is."""

    deployment: ModelDeployment
    index: int
    spare: bool
    backoff_s: float
    state: SlotState = SlotState.WAITING
    worker: LaunchedWorker | None = None
    started_at: float = 0.0
    next_start: float = 0.0
    restarts: int = 0
    last_exit: int | None = None

    def describe(self) -> dict:
        worker = self.worker
        return {
            "model": self.deployment.name,
            "role": self.deployment.role,
            "slot": self.index,
            "state": str(self.state),
            "pid": worker.process.pid if worker else None,
            "url": worker.url if worker else None,
            "log": str(worker.log_path) if worker else None,
            "node": worker.node if worker else None,
            "stage_nodes": list(worker.stage_nodes) if worker else [],
            "restarts": self.restarts,
            "last_exit": self.last_exit,
        }


class Launcher(Protocol):
    """Starts one worker of a deployment (LocalLauncher, RayLauncher); may block."""

    def start(self, deployment: ModelDeployment, slot: int) -> LaunchedWorker: ...


def _no_event(kind: str, change: str, reason: str = "", worker_id: str | None = None, **details: object) -> None:
    pass


@dataclass(frozen=True)
class RouterLink:
    """How the supervisor puts a worker into the router and takes it out, and tells it what
    happened to the workers (`event` takes ClusterEvents.record's arguments)."""

    join: Callable[[str, str], Awaitable[None]]  # (worker url, model name)
    leave: Callable[[str], None]
    event: Callable[..., None] = _no_event


class Supervisor:
    def __init__(
        self,
        launcher: Launcher,
        deployments: list[ModelDeployment],
        settings: SupervisorSettings,
        router: RouterLink,
        status_path: Path,
    ):
        self.launcher = launcher
        self.settings = settings
        self.router = router
        self.status_path = status_path
        self.all_deployments = list(deployments)
        self.deployments = {d.name: d for d in deployments if d.role == "colocated"}  # those that scale
        self.slots = [
            Slot(d, i, spare=i >= d.replicas, backoff_s=settings.restart_backoff_s)
            for d in deployments
            for i in range(d.replicas + d.warm_spares)
        ]
        self.waiting_ready: set[asyncio.Task] = set()
        self.draining: list[subprocess.Popen] = []  # removed by a scale-down or a restart, finishing requests
        self.restarting = asyncio.Lock()

    def check(self, now: float) -> bool:
        """Starts what is due and handles exits; True when something changed."""
        self.draining = [process for process in self.draining if process.poll() is None]
        changed = False
        for slot in self.slots:
            if slot.state is SlotState.WAITING:
                if now >= slot.next_start:
                    self._start(slot, now)
                    changed = True
            elif slot.worker is not None and slot.worker.process.poll() is not None:
                self._exited(slot, now)
                changed = True
        return changed

    def _start(self, slot: Slot, now: float) -> None:
        slot.state, slot.started_at = SlotState.STARTING, now
        task = asyncio.create_task(self._launch(slot))
        self.waiting_ready.add(task)
        task.add_done_callback(self.waiting_ready.discard)

    async def _launch(self, slot: Slot) -> None:
        """Starts the slot's worker off the event loop (a remote launcher waits for placement),
        then waits for it to be ready."""
        try:
            worker = await asyncio.to_thread(self.launcher.start, slot.deployment, slot.index)
        except Exception as exc:  # e.g. no node has the resources: try again after the backoff
            log.warning(
                "could not start %s %d: %s; retrying in %.1f s", slot.deployment.name, slot.index, exc, slot.backoff_s
            )
            self.router.event(
                "lifecycle",
                "start_failed",
                f"{exc}; retrying in {slot.backoff_s:.1f} s",
                model=slot.deployment.name,
                slot=slot.index,
            )
            self._retry_later(slot, time.monotonic())
            return
        if slot not in self.slots:  # scaled away while it was being launched
            worker.process.send_signal(signal.SIGTERM)
            self.draining.append(worker.process)
            return
        slot.worker = worker
        log.info(
            "started %s %s %d at %s (pid %d%s)",
            slot.deployment.name,
            "spare" if slot.spare else "replica",
            slot.index,
            worker.url,
            worker.process.pid,
            f" on node {worker.node}" if worker.node else "",
        )
        self.router.event(
            "lifecycle",
            "started",
            f"{'spare' if slot.spare else 'replica'} {slot.index}, pid "
            f"{worker.process.pid}{f' on node {worker.node}' if worker.node else ''}; loading",
            worker_id=worker.url,
            model=slot.deployment.name,
            slot=slot.index,
        )
        self.write_status()
        await self._when_ready(slot, worker)

    def _exited(self, slot: Slot, now: float) -> None:
        """A clean exit (0: drained on SIGTERM) restarts after the base backoff and does not count
        as a crash; a crash doubles the next backoff unless the worker had run healthy_after_s."""
        code, ran = slot.worker.process.returncode, now - slot.started_at
        crashed = code != 0
        if slot.state is SlotState.SERVING:
            self.router.leave(slot.worker.url)
        if ran >= self.settings.healthy_after_s or not crashed:
            slot.backoff_s = self.settings.restart_backoff_s
        log.warning(
            "%s %d (pid %d) exited with %s after %.1f s; restarting in %.1f s",
            slot.deployment.name,
            slot.index,
            slot.worker.process.pid,
            code,
            ran,
            slot.backoff_s,
        )
        self.router.event(
            "lifecycle",
            "exited",
            f"pid {slot.worker.process.pid} exited with {code} after {ran:.1f} s; restarting in {slot.backoff_s:.1f} s",
            worker_id=slot.worker.url,
            model=slot.deployment.name,
            slot=slot.index,
            exit_code=code,
        )
        if slot.state is SlotState.SERVING:
            self._promote_spare(slot)
        slot.worker, slot.last_exit, slot.restarts = None, code, slot.restarts + 1
        self._retry_later(slot, now, escalate=crashed)

    def _retry_later(self, slot: Slot, now: float, escalate: bool = True) -> None:
        """The slot starts again after its backoff, which doubles for the next time (capped) when
        `escalate`."""
        slot.state, slot.next_start = SlotState.WAITING, now + slot.backoff_s
        if not escalate:
            return
        slot.backoff_s = min(
            max(slot.backoff_s * 2, self.settings.restart_backoff_s), self.settings.max_restart_backoff_s
        )

    def _promote_spare(self, lost: Slot) -> None:
        """A ready spare of the lost replica's model takes its place; the lost slot becomes a spare."""
        spare = next((s for s in self.slots if s.deployment is lost.deployment and s.state is SlotState.SPARE), None)
        if spare is None:
            return
        spare.spare, lost.spare = False, True
        spare.state = SlotState.SERVING  # now, so that no other loss promotes the same spare
        log.info("promoting warm spare %s to replace %s", spare.worker.url, lost.worker.url)
        self.router.event(
            "lifecycle",
            "promoted",
            f"warm spare replaces {lost.worker.url}",
            worker_id=spare.worker.url,
            model=spare.deployment.name,
            slot=spare.index,
        )
        task = asyncio.create_task(self._serve(spare, spare.worker))
        self.waiting_ready.add(task)
        task.add_done_callback(self.waiting_ready.discard)

    async def _serve(self, slot: Slot, worker: LaunchedWorker) -> None:
        if slot.worker is not worker or slot not in self.slots:
            return  # it exited, was replaced or was scaled away meanwhile
        slot.state = SlotState.SERVING
        await self.router.join(worker.url, slot.deployment.name)
        self.router.event(
            "lifecycle", "joined", "ready; serving", worker_id=worker.url, model=slot.deployment.name, slot=slot.index
        )
        self.write_status()

    async def _when_ready(self, slot: Slot, worker: LaunchedWorker) -> None:
        """Waits for the worker's /ready; then it serves, or waits as a spare."""
        async with httpx.AsyncClient(timeout=2) as client:
            while worker.process.poll() is None:
                try:
                    if (await client.get(worker.url + "/ready")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.2)
        if slot.worker is not worker or worker.process.poll() is not None:
            return  # it exited or was replaced meanwhile
        if slot.spare:
            slot.state = SlotState.SPARE
            log.info("%s spare %d ready at %s", slot.deployment.name, slot.index, worker.url)
            self.router.event(
                "lifecycle",
                "spare_ready",
                "ready; waiting as a warm spare",
                worker_id=worker.url,
                model=slot.deployment.name,
                slot=slot.index,
            )
            self.write_status()
        else:
            await self._serve(slot, worker)

    def _scaled(self, model: str) -> list[Slot]:
        """The replica slots of the model's colocated workers (not its spares nor its P/D pools)."""
        return [
            s for s in self.slots if s.deployment.name == model and s.deployment.role == "colocated" and not s.spare
        ]

    def replicas(self, model: str) -> int:
        return len(self._scaled(model))

    def starting(self, model: str) -> int:
        """Replicas of the model that are not serving yet."""
        return sum(1 for s in self._scaled(model) if s.state is not SlotState.SERVING)

    def scale(self, model: str, replicas: int, reason: str = "") -> None:
        """Adds replica slots (they start at the next check) or removes them: those not serving yet
        first, then the newest; a serving one leaves the router and drains."""
        slots = self._scaled(model)
        if replicas != len(slots):
            self.router.event(
                "scaling",
                "scaled_up" if replicas > len(slots) else "scaled_down",
                f"{len(slots)} → {replicas} replicas" + (f": {reason}" if reason else ""),
                model=model,
                replicas=replicas,
                previous_replicas=len(slots),
            )
        if replicas > len(slots):
            deployment = self.deployments[model]
            first = max((s.index for s in self.slots if s.deployment is deployment), default=-1) + 1
            self.slots += [
                Slot(deployment, first + i, spare=False, backoff_s=self.settings.restart_backoff_s)
                for i in range(replicas - len(slots))
            ]
        for slot in sorted(slots, key=lambda s: (s.state is SlotState.SERVING, -s.index))[
            : max(len(slots) - replicas, 0)
        ]:
            self.slots.remove(slot)
            if slot.worker is None:
                continue
            if slot.state is SlotState.SERVING:
                self.router.leave(slot.worker.url)
            slot.worker.process.send_signal(signal.SIGTERM)
            self.draining.append(slot.worker.process)
            self.router.event(
                "lifecycle",
                "draining",
                "scaled down: left the router, finishing its requests",
                worker_id=slot.worker.url,
                model=model,
                slot=slot.index,
            )
        self.write_status()

    async def rolling_restart(self, model: str) -> int:
        """Replaces each serving replica of `model` in turn: a new worker starts, becomes ready and
        joins, then the old one leaves the router and drains. A replica that is not serving when its
        turn comes is skipped; if a new worker fails to become ready, the old one keeps serving and
        the restart stops. One restart at a time. Returns the replicas replaced."""
        async with self.restarting:
            self.router.event("scaling", "rolling_restart", "replacing the replicas one at a time", model=model)
            replaced = 0
            for slot in [s for s in self.slots if s.deployment.name == model and not s.spare]:
                old = slot.worker
                if slot not in self.slots or slot.state is not SlotState.SERVING or old is None:
                    continue
                new = await asyncio.to_thread(self.launcher.start, slot.deployment, slot.index)
                if slot.worker is not old or slot.state is not SlotState.SERVING:  # old one exited meanwhile
                    new.process.send_signal(signal.SIGTERM)
                    self.draining.append(new.process)
                    continue
                slot.worker = new  # check() now watches the new one; the old one is ours to drain
                await self._when_ready(slot, new)
                if slot.worker is not new or new.process.poll() is not None:
                    log.warning(
                        "rolling restart of %s stopped: the new replica %d did not become ready", model, slot.index
                    )
                    self.router.event(
                        "lifecycle",
                        "restart_failed",
                        "rolling restart stopped: the new replica did not become ready",
                        worker_id=new.url,
                        model=model,
                        slot=slot.index,
                    )
                    if new.process.poll() is None:
                        new.process.kill()
                    if slot.state is SlotState.WAITING:  # take back the old worker instead of a restart
                        slot.worker, slot.state = old, SlotState.SERVING
                    return replaced
                self.router.leave(old.url)
                old.process.send_signal(signal.SIGTERM)
                self.draining.append(old.process)
                self.router.event(
                    "lifecycle",
                    "draining",
                    f"rolling restart: replaced by {new.url}",
                    worker_id=old.url,
                    model=model,
                    slot=slot.index,
                )
                replaced += 1
                self.write_status()
            return replaced

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
        for task in self.waiting_ready:
            task.cancel()
        running = [slot.worker.process for slot in self.slots if slot.worker is not None]
        for process in running:
            process.send_signal(signal.SIGTERM)
        processes = running + self.draining
        deadline = time.monotonic() + max((d.drain_grace_s for d in self.all_deployments), default=0) + 5
        while any(p.poll() is None for p in processes) and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        for process in processes:
            if process.poll() is None:
                log.warning("worker pid %d did not drain in time; killed", process.pid)
                process.kill()
                process.wait()
        self.status_path.unlink(missing_ok=True)
