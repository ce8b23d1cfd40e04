"""Session affinity by consistent hashing with bounded load.

Each worker owns `virtual_nodes` points on a hash ring; a session key goes to the first worker
clockwise from its hash whose load is under capacity = ceil(load_factor x (total load + 1) / workers).
A membership change moves only the keys of the ring arcs that changed hands (about 1/N of them), and
no worker takes more than its bounded share, so a hot session spills to its ring neighbour instead of
overloading one node. Requests without a session key use the fallback policy.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from shoal.router.placement.policies.cost import CostPolicy
from shoal.router.views import RouteRequest, RoutingContext, WorkerView


def ring_hash(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


@functools.lru_cache(maxsize=64)
def _ring(worker_ids: frozenset[str], virtual_nodes: int) -> tuple[list[int], list[str]]:
    points = sorted(
        (ring_hash(f"{worker_id}#{i}"), worker_id) for worker_id in worker_ids for i in range(virtual_nodes)
    )
    return [p for p, _ in points], [w for _, w in points]


@dataclass(frozen=True)
class SessionAffinity:
    virtual_nodes: int = 64
    load_factor: float = 1.25
    fallback: CostPolicy = field(default_factory=CostPolicy)
    name: str = "session_affinity"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView], context: RoutingContext) -> WorkerView:
        if not request.session_key:
            return self.fallback.choose(request, workers, context)
        by_id = {w.worker_id: w for w in workers}
        hashes, owners = _ring(frozenset(by_id), self.virtual_nodes)
        capacity = math.ceil(self.load_factor * (sum(w.load for w in workers) + 1) / len(workers))
        start = bisect.bisect(hashes, ring_hash(request.session_key))
        for step in range(len(owners)):
            worker = by_id[owners[(start + step) % len(owners)]]
            if worker.load < capacity:
                return worker
        return by_id[owners[start % len(owners)]]
