"""The policy contract and the hard constraints every policy respects."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from shoal.router.views import RouteRequest, RoutingContext, WorkerView


class Policy(Protocol):
    """choose() returns one of `workers` (already filtered to eligible ones, never empty).
    Invariant: it reads its arguments only, so the same inputs give the same choice."""

    name: str

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView], context: RoutingContext) -> WorkerView: ...


def eligible(request: RouteRequest, workers: Sequence[WorkerView]) -> list[WorkerView]:
    """Healthy workers serving the model whose context window holds prompt + expected output.
    Among them, those whose free KV memory holds the request now are preferred; if none has the
    room free, those whose whole KV cache could hold it (they will queue it)."""
    serving = [w for w in workers if w.healthy and request.model in w.models
               and (w.max_model_len is None or request.total_tokens <= w.max_model_len)]
    room_now = [w for w in serving if w.free_kv_tokens is None or w.free_kv_tokens >= request.total_tokens]
    if room_now:
        return room_now
    return [w for w in serving if w.kv_capacity_tokens is None or w.kv_capacity_tokens >= request.total_tokens]
