"""Cache-aware routing with load guards (the approach of SGLang's router).

When the fleet is imbalanced (the busiest worker has more than `balance_abs_threshold` requests
over the idlest and more than `balance_rel_threshold` times as many), load wins: the least loaded
worker gets the request. Otherwise the worker the longest prefix was sent to (`affinity_blocks`)
gets it if at least `cache_threshold` of the prompt's blocks match and that worker is not overloaded; a cache miss goes
to the least loaded worker that is not overloaded, never to an overloaded one. A block likely in a
worker's KV tier counts for the share of its prefill that copying it back saves (tier_cost).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from shoal.router.placement.policies.cost import DEFAULT_PREFILL_TOKENS_PER_S
from shoal.router.placement.tier_cost import effective_matched_blocks
from shoal.router.views import RouteRequest, RoutingContext, WorkerView


def affinity_blocks(worker: WorkerView, context: RoutingContext) -> float:
    """The prompt's leading blocks last sent to the worker: those believed cached at their worth
    (tier blocks at the share of the prefill they save), the rest, likely evicted, in full, as
    SGLang's record of what it sent keeps them. Under KV pressure this keeps a prefix's requests
    together instead of treating every evicted prefix as new."""
    prefill = worker.prefill_tokens_per_s or DEFAULT_PREFILL_TOKENS_PER_S
    matched = context.matched_blocks.get(worker.worker_id, 0)
    placed = context.placed_blocks.get(worker.worker_id, matched)
    return effective_matched_blocks(worker, context, prefill) + placed - matched


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
        value = {w.worker_id: affinity_blocks(w, context) for w in workers}
        best = max(workers, key=lambda w: (value[w.worker_id], -w.load, w.worker_id))
        matched = value[best.worker_id]
        if request.prefix_blocks and matched >= self.cache_threshold * len(request.prefix_blocks):
            return best
        return least_loaded
