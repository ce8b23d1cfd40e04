"""NVIDIA Dynamo's KV router, from its published description: each worker's cost is

    overlap_score_weight × prefill blocks + decode blocks

where prefill blocks are the request's blocks the worker does not hold (to compute) and decode
blocks the KV blocks active on it; the lowest cost wins. With `temperature` > 0 the worker is drawn
by a softmax over the negated costs, normalised by the largest, instead. Here blocks are counted in
tokens (the same scale for every worker).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.router.views import RouteRequest, RoutingContext, WorkerView


@dataclass(frozen=True)
class DynamoKVCost:
    overlap_score_weight: float = 1.0
    temperature: float = 0.0
    name: str = "dynamo_kv"

    def cost(self, request: RouteRequest, worker: WorkerView, context: RoutingContext) -> float:
        prefill = request.prompt_tokens - context.cached_tokens(request, worker)
        active = (worker.kv_capacity_tokens or 0) - (worker.free_kv_tokens or 0) if worker.kv_capacity_tokens else 0
        return self.overlap_score_weight * prefill + max(active, 0)

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView], context: RoutingContext) -> WorkerView:
        costs = {w.worker_id: self.cost(request, w, context) for w in workers}
        if self.temperature <= 0:
            return min(workers, key=lambda w: (costs[w.worker_id], w.worker_id))
        scale = max(costs.values()) or 1.0
        weights = [math.exp(-costs[w.worker_id] / scale / self.temperature) for w in workers]
        return context.rng.choices(list(workers), weights=weights)[0]
