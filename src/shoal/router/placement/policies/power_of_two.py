"""Power of two choices: sample two workers at random, send to the less loaded one (outstanding
tokens, then request count). Near-optimal balance without herding on one stale minimum."""

from __future__ import annotations

from collections.abc import Sequence

from shoal.router.views import RouteRequest, RoutingContext, WorkerView


class PowerOfTwoChoices:
    name = "power_of_two"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView], context: RoutingContext) -> WorkerView:
        if len(workers) == 1:
            return workers[0]
        first, second = context.rng.sample(list(workers), 2)
        return min((first, second), key=lambda w: (w.outstanding_tokens, w.load))
