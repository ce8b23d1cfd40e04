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
    room free, those whose whole KV cache could hold it (they will queue it).

    The router only estimates token counts: a request too long, by that estimate, for every
    serving worker's window or whole KV cache goes to the workers with the largest of them, which
    count exactly and either serve it or refuse it (400, context_length_exceeded). So the result
    is empty only when no healthy worker serves the model."""
    serving = [w for w in workers if w.healthy and request.model in w.models]
    in_window = [w for w in serving if w.max_model_len is None or request.total_tokens <= w.max_model_len]
    if not in_window:
        return _largest(serving, lambda w: w.max_model_len)
    room_now = [w for w in in_window if w.free_kv_tokens is None or w.free_kv_tokens >= request.total_tokens]
    if room_now:
        return room_now
    fits = [w for w in in_window if w.kv_capacity_tokens is None or w.kv_capacity_tokens >= request.total_tokens]
    return fits or _largest(in_window, lambda w: w.kv_capacity_tokens)


def _largest(workers: list[WorkerView], size) -> list[WorkerView]:
    most = max((size(w) for w in workers), default=None)
    return [w for w in workers if size(w) == most]
