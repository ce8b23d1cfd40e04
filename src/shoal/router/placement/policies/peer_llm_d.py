"""llm-d's inference scheduler (its endpoint picker's default profile), from its published
description: every worker is scored by weighted scorers and the highest total wins.

- prefix-cache scorer (weight 3): the share of the request's prefix blocks the worker holds;
- queue scorer (weight 2): (most waiting - its waiting) / (most - least waiting), 1 for all when
  the queues are equal;
- KV-cache utilization scorer (weight 2): 1 - its KV cache usage.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shoal.router.views import RouteRequest, RoutingContext, WorkerView


def kv_usage(worker: WorkerView) -> float:
    """The share of its KV cache in use (0 when it does not say)."""
    if not worker.kv_capacity_tokens or worker.free_kv_tokens is None:
        return 0.0
    return 1.0 - worker.free_kv_tokens / worker.kv_capacity_tokens


@dataclass(frozen=True)
class LlmDWeightedScorers:
    prefix_weight: float = 3.0
    queue_weight: float = 2.0
    kv_weight: float = 2.0
    name: str = "llm_d"

    def scores(self, request: RouteRequest, workers: Sequence[WorkerView], context: RoutingContext) -> dict[str, float]:
        most, least = max(w.waiting for w in workers), min(w.waiting for w in workers)
        blocks = len(request.prefix_blocks)
        totals = {}
        for w in workers:
            prefix = context.matched_blocks.get(w.worker_id, 0) / blocks if blocks else 0.0
            queue = (most - w.waiting) / (most - least) if most > least else 1.0
            totals[w.worker_id] = (
                self.prefix_weight * prefix + self.queue_weight * queue + self.kv_weight * (1.0 - kv_usage(w))
            )
        return totals

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView], context: RoutingContext) -> WorkerView:
        totals = self.scores(request, workers, context)
        return max(workers, key=lambda w: (totals[w.worker_id], -w.load, w.worker_id))
