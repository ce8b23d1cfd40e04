"""SGLang Model Gateway's (and vllm-router's) cache_aware policy, from its published description,
with its defaults, for comparing policies in the simulator and on a cluster.

When the busiest worker has more than `balance_abs_threshold` (64) requests over the idlest and
more than `balance_rel_threshold` (1.5) times as many, the least loaded worker gets the request.
Otherwise the worker whose record (a radix tree of what it was sent) shares the longest prefix with
the request gets it when that share reaches `cache_threshold` (0.3) of the request; below that, the
worker with the smallest record (the most room to cache). Here the record is the router's prefix
index, by blocks of text, as for shoal's own policies; its tree is far larger than a worker's cache,
so what it was sent counts whether or not the cache still holds it (`placed_blocks`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shoal.router.views import RouteRequest, RoutingContext, WorkerView


@dataclass(frozen=True)
class SGLangCacheAware:
    cache_threshold: float = 0.3
    balance_abs_threshold: int = 64
    balance_rel_threshold: float = 1.5
    name: str = "sglang_cache_aware"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView], context: RoutingContext) -> WorkerView:
        busiest = max(w.load for w in workers)
        idlest = min(w.load for w in workers)
        if busiest - idlest > self.balance_abs_threshold and busiest > idlest * self.balance_rel_threshold:
            return min(workers, key=lambda w: (w.load, w.worker_id))
        best = max(workers, key=lambda w: (context.placed_blocks.get(w.worker_id, 0), -w.load, w.worker_id))
        matched = context.placed_blocks.get(best.worker_id, 0)
        if request.prefix_blocks and matched >= self.cache_threshold * len(request.prefix_blocks):
            return best
        return min(workers, key=lambda w: (context.recorded_blocks(w.worker_id), w.load, w.worker_id))
