"""The supervisor's bookkeeping when several workers exit at once (driven with stand-in processes;
the real ones are exercised by tests/integration/test_serve.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from shoal.cluster.config import ModelDeployment, SupervisorSettings
from shoal.cluster.launcher_local import LaunchedWorker
from shoal.cluster.supervisor import RouterLink, SlotState, Supervisor
from tests.support.stand_in_process import StandInProcess


def serving_fleet(tmp_path: Path, replicas: int, spares: int):
    joined, left = [], []

    async def join(url, model):
        joined.append(url)

    supervisor = Supervisor(
        launcher=None,
        deployments=[ModelDeployment(name="m", replicas=replicas, warm_spares=spares)],
        settings=SupervisorSettings(restart_backoff_s=5),
        router=RouterLink(join, left.append),
        status_path=tmp_path / "workers.json",
    )
    for slot in supervisor.slots:
        slot.worker = LaunchedWorker(StandInProcess(), f"http://w{slot.index}", tmp_path / "log")
        slot.state = SlotState.SPARE if slot.spare else SlotState.SERVING
    return supervisor, joined, left


def test_two_replicas_lost_at_once_promote_the_one_spare_once(tmp_path):
    async def scenario():
        supervisor, joined, left = serving_fleet(tmp_path, replicas=2, spares=1)
        for slot in supervisor.slots[:2]:
            slot.worker.process.kill()
        supervisor.check(now=10.0)
        await asyncio.sleep(0)
        await asyncio.gather(*supervisor.waiting_ready)
        states = [(s.index, s.spare, s.state) for s in supervisor.slots]
        assert states == [(0, True, SlotState.WAITING), (1, False, SlotState.WAITING), (2, False, SlotState.SERVING)]
        assert joined == ["http://w2"] and sorted(left) == ["http://w0", "http://w1"]
        assert supervisor.replicas("m") == 2

    asyncio.run(scenario())


def test_a_spare_lost_with_the_replica_it_would_replace_is_restarted_not_half_promoted(tmp_path):
    async def scenario():
        supervisor, joined, _ = serving_fleet(tmp_path, replicas=1, spares=1)
        for slot in supervisor.slots:
            slot.worker.process.kill()
        supervisor.check(now=10.0)
        await asyncio.gather(*supervisor.waiting_ready)
        assert all(s.state is SlotState.WAITING and s.worker is None for s in supervisor.slots)
        assert joined == [] and supervisor.replicas("m") == 1

    asyncio.run(scenario())


def test_crashes_in_a_row_back_off_but_a_clean_exit_restarts_at_the_base_backoff(tmp_path):
    async def scenario():
        supervisor, _, _ = serving_fleet(tmp_path, replicas=1, spares=0)
        [slot] = supervisor.slots
        waits = []
        for code in (-9, -9, 0, -9):
            slot.worker = LaunchedWorker(StandInProcess(), "http://w0", tmp_path / "log")
            slot.state, slot.started_at = SlotState.SERVING, 10.0
            slot.worker.process.returncode = code
            supervisor.check(now=11.0)
            waits.append(slot.next_start - 11.0)
        assert waits == [5, 10, 5, 5]  # doubled after a crash; a clean exit resets and does not double

    asyncio.run(scenario())
