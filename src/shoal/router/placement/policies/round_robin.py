"""Round robin over the eligible workers, by the router's request counter."""

from __future__ import annotations

from collections.abc import Sequence

from shoal.router.views import RouteRequest, RoutingContext, WorkerView


class RoundRobin:
    name = "round_robin"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView], context: RoutingContext) -> WorkerView:
        ordered = sorted(workers, key=lambda w: w.worker_id)
        return ordered[context.sequence_number % len(ordered)]
