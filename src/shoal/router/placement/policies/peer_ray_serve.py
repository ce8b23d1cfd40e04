"""Ray Serve LLM's PrefixCacheAffinityRouter, from its published description.

When the queues are balanced (the longest at most `imbalanced_threshold` requests over the
shortest), the worker with the highest prefix match rate gets the request if that rate reaches
`match_rate_threshold` (10%); below it, the worker with the smallest prefix record (the least
cache in use). When they are not balanced, power of two choices on queue length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shoal.router.views import RouteRequest, RoutingContext, WorkerView


@dataclass(frozen=True)
class RayPrefixAffinity:
    imbalanced_threshold: int = 10
    match_rate_threshold: float = 0.1
    name: str = "ray_prefix_affinity"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView], context: RoutingContext) -> WorkerView:
        if max(w.load for w in workers) - min(w.load for w in workers) > self.imbalanced_threshold:
            pair = context.rng.sample(list(workers), 2) if len(workers) > 1 else list(workers)
            return min(pair, key=lambda w: (w.load, w.worker_id))
        blocks = len(request.prefix_blocks)
        best = max(workers, key=lambda w: (context.matched_blocks.get(w.worker_id, 0), -w.load, w.worker_id))
        if blocks and context.matched_blocks.get(best.worker_id, 0) / blocks >= self.match_rate_threshold:
            return best
        return min(workers, key=lambda w: (context.recorded_blocks(w.worker_id), w.load, w.worker_id))
