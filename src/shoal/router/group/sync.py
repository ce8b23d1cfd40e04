"""One member of a router group, kept routing as the group does (see router_group for the group).

What reaches one member is told to the others over the group bus, within one turn of its event
loop: workers that registered, heartbeat or were removed through it; the prefix blocks of each of
its placements; its own requests in flight on each worker (its totals, sent when they change);
admission slots it gave back (the slots themselves are counted in GroupSlots).

Consistency, for those who read the figures:
- registrations, heartbeats, removals, placements and in-flight totals reach every member within
  one loop turn of the member that saw them (well under a millisecond on an idle machine); in that
  window two members may both place a request on a worker the other just filled;
- a member restarted by its group starts with an empty prefix index and learns as traffic flows;
  the workers and in-flight totals of the others reach it when it connects;
- each member polls static workers and judges health on its own: a worker one member found down
  may get a request from another until that one finds it too (within its own probe interval),
  and that request fails over as usual;
- admission is exact: the group never holds more slots of a model than its capacity.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from shoal.protocol.group_events import Beat, Event, Joined, Left, Placed, SlotFreed, Work
from shoal.protocol.worker_load import WorkerLoad
from shoal.router.admission.queues import Admission
from shoal.router.fleet.membership import Membership, normalize_url
from shoal.router.fleet.worker_state import WorkerState
from shoal.router.group.bus import GroupBus
from shoal.router.placement.balancer import Balancer


@dataclass(frozen=True)
class GroupMember:
    """This process's seat in a router group: its number of `members`, the group's private
    directory (its channel's sockets, the slot table, the members' metric files) and the group's
    token."""

    directory: Path
    member: int
    members: int
    token: bytes

    @property
    def slots_path(self) -> Path:
        return self.directory / "admission-slots"

    @property
    def metrics_directory(self) -> Path:
        """Where every member's counters and histograms live (prometheus_client's multiprocess
        mode: PROMETHEUS_MULTIPROC_DIR names it in each member's environment from its start)."""
        return metrics_directory(self.directory)


def metrics_directory(group_directory: Path) -> Path:
    return group_directory / "metrics"


class GroupSync:
    def __init__(self, membership: Membership, balancer: Balancer, admission: Admission):
        self.membership, self.balancer, self.admission = membership, balancer, admission
        self.bus: GroupBus | None = None  # set by the app's lifespan, once its loop runs
        self._dirty: set[str] = set()
        membership.work_changed = self._work_changed
        balancer.placed = self._placed
        admission.released = self._slot_freed

    # what this member tells the others
    def joined(self, url: str, models: list[str], load: WorkerLoad | None) -> None:
        self._publish(Joined(url=normalize_url(url), models=models, load=load))

    def beat(self, worker_id: str, load: WorkerLoad | None) -> None:
        self._publish(Beat(worker_id=normalize_url(worker_id), load=load))

    def left(self, worker_id: str) -> None:
        self._publish(Left(worker_id=worker_id))

    def _placed(self, worker_id: str, blocks: tuple[bytes, ...], capacity_blocks: int) -> None:
        self._publish(Placed(worker_id=worker_id, blocks=list(blocks), capacity_blocks=capacity_blocks))

    def _slot_freed(self, model: str) -> None:
        self._publish(SlotFreed(model=model))

    def _work_changed(self, state: WorkerState) -> None:
        if self.bus is None:
            return
        if not self._dirty:
            asyncio.get_running_loop().call_soon(self._send_work)
        self._dirty.add(state.worker_id)

    def _send_work(self) -> None:
        for worker_id in self._dirty:
            state = self.membership.workers.get(worker_id)
            if state is not None:
                self._publish(_work_of(state))
        self._dirty.clear()

    def _publish(self, event: Event) -> None:
        if self.bus is not None:
            self.bus.publish(event)

    def snapshot(self) -> list[Event]:
        """What a member that (re)connects must hear at once: the workers known here, and this
        member's work in flight."""
        workers = list(self.membership.workers.values())
        return [Joined(url=w.url, models=sorted(w.base_models)) for w in workers if w.registered] + [
            _work_of(w) for w in workers if w.in_flight
        ]

    # what the others tell this member
    def apply(self, member: int, events: list[Event]) -> None:
        membership = self.membership
        for event in events:
            if isinstance(event, Work):
                state = membership.workers.get(event.worker_id)
                if state is not None:
                    state.set_elsewhere(member, event.requests, event.prefill_tokens, event.decode_tokens)
            elif isinstance(event, Placed):
                self.balancer.prefix_index.record(event.worker_id, tuple(event.blocks), event.capacity_blocks)
            elif isinstance(event, Beat):
                membership.heartbeat(event.worker_id, event.load)
            elif isinstance(event, SlotFreed):
                self.admission.wake()
            elif isinstance(event, Joined):
                membership.register(event.url, event.models, event.load)
                self.admission.wake()
            elif isinstance(event, Left):
                if membership.remove(event.worker_id) is not None:
                    self.balancer.forget(event.worker_id)

    def gone(self, member: int) -> None:
        """A member's connection closed: what it had in flight is no longer counted."""
        for state in self.membership.workers.values():
            state.set_elsewhere(member, 0, 0, 0)


def _work_of(state: WorkerState) -> Work:
    return Work(
        worker_id=state.worker_id,
        requests=len(state.in_flight),
        prefill_tokens=state.prefill_tokens,
        decode_tokens=state.decode_tokens,
    )
