"""The router's Membership, with each worker's view rebuilt only after something changed it."""

from __future__ import annotations

from shoal.router.fleet.membership import Membership
from shoal.router.views import WorkerView


class CachedMembership(Membership):
    """The router's own Membership (registration, heartbeats with load reports, WorkerState and
    its view), except that `views()` reuses each worker's last view until `changed` names it. At a
    thousand workers, building every view for every decision would cost more than the rest of
    the simulation together.

    Invariant: the views returned equal [state.view() for state in workers.values()], provided
    that whoever changes a WorkerState outside `register` and `heartbeat` (placements, releases,
    first bytes, down flags) calls `changed` before the next `views()`."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._views: list[WorkerView] = []
        self._positions: dict[str, int] = {}
        self._changed: set[str] = set()

    def changed(self, worker_id: str) -> None:
        if worker_id not in self._positions:  # a new worker takes the next place, as in `workers`
            self._positions[worker_id] = len(self._views)
            self._views.append(self.workers[worker_id].view())
        self._changed.add(worker_id)

    def heartbeat(self, worker_id: str, report: dict | None) -> bool:
        known = super().heartbeat(worker_id, report)
        self.changed(worker_id)
        return known

    def views(self) -> list[WorkerView]:
        for worker_id in self._changed:
            self._views[self._positions[worker_id]] = self.workers[worker_id].view()
        self._changed.clear()
        return list(self._views)
