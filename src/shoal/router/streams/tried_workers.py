"""The workers one request (one choice of it) has left, and whether each may take it again."""

from __future__ import annotations

from collections.abc import Mapping

from shoal.router.fleet.worker_state import WorkerState
from shoal.router.views import RouteRequest


class TriedWorkers:
    """Invariant: a worker is in at most one of `failed` and `left`. A worker that failed the
    request (answered 5xx other than 503, sent an error event) is excluded for the rest of the
    request. One left for looking hung (its token deadline), for refusing the request for now (503:
    draining or overloaded), for a lost connection (its process died: a restarted one comes back at
    the same address), or whose stream the health monitor cut (down, ejected), is
    excluded only until the router hears from it again (a poll or heartbeat after it was left);
    whether it may then get work is the balancer's to say."""

    def __init__(self) -> None:
        self.failed: set[str] = set()
        self.left: dict[str, float] = {}  # worker id -> time.monotonic() when it was left

    def fail(self, worker_id: str) -> None:
        self.left.pop(worker_id, None)
        self.failed.add(worker_id)

    def leave(self, worker_id: str, now: float) -> None:
        if worker_id not in self.failed:
            self.left[worker_id] = now

    def failed_by_all(self, workers: Mapping[str, WorkerState], routed: RouteRequest) -> bool:
        """Every worker serving the request's model (at least one) has failed it: no use waiting."""
        serving = [
            worker_id for worker_id, worker in workers.items() if worker.serves(routed.model, routed.loadable_of)
        ]
        return bool(serving) and all(worker_id in self.failed for worker_id in serving)

    def excluded(self, workers: Mapping[str, WorkerState]) -> frozenset[str]:
        """Worker ids that may not take the request now."""
        silent = {
            worker_id
            for worker_id, at in self.left.items()
            if worker_id not in workers or workers[worker_id].last_seen <= at
        }
        return frozenset(self.failed | silent)
