"""Cache-aware routing with load guards (the approach of SGLang's router).

When the fleet is imbalanced (the busiest worker has more than `balance_abs_threshold` requests
over the idlest and more than `balance_rel_threshold` times as many), load wins: the least loaded
worker gets the request. Otherwise the worker holding the longest cached prefix gets it if at least
`cache_threshold` of the prompt's blocks match and that worker is not overloaded; a cache miss goes
to the least loaded worker that is not overloaded, never to an overloaded one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shoal.router.views import RouteRequest, RoutingContext, WorkerView


@dataclass(frozen=True)
class CacheAware:
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 32
    balance_rel_threshold: float = 1.5
    name: str = "cache_aware"

    def overloaded(self, worker: WorkerView, idlest_load: int) -> bool:
        return (
            worker.load - idlest_load > self.balance_abs_threshold
            and worker.load > idlest_load * self.balance_rel_threshold
        )

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView], context: RoutingContext) -> WorkerView:
        least_loaded = min(workers, key=lambda w: (w.load, w.outstanding_tokens, w.worker_id))
        if any(self.overloaded(w, least_loaded.load) for w in workers):
            return least_loaded
        best = max(workers, key=lambda w: (context.matched_blocks.get(w.worker_id, 0), -w.load, w.worker_id))
        matched = context.matched_blocks.get(best.worker_id, 0)
        if request.prefix_blocks and matched >= self.cache_threshold * len(request.prefix_blocks):
            return best
        return least_loaded
