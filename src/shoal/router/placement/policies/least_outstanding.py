"""Least outstanding tokens: the worker with the least prefill + decode work still to do."""

from __future__ import annotations

from collections.abc import Sequence

from shoal.router.views import RouteRequest, RoutingContext, WorkerView


class LeastOutstandingTokens:
    name = "least_outstanding_tokens"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView], context: RoutingContext) -> WorkerView:
        return min(workers, key=lambda w: (w.outstanding_tokens, w.load, w.worker_id))
