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
    """Healthy workers serving the model whose context window and whole KV cache hold prompt +
    expected output. A worker without the room free now is eligible: it queues the request until
    a running one ends, and whether that is worth it (its cache may hold most of the prompt) is
    the policy's to weigh, not a filter's.

    The router only estimates token counts: a request too long, by that estimate, for every
    serving worker's window or whole KV cache goes to the workers with the largest of them, which
    count exactly and either serve it or refuse it (400, context_length_exceeded). So the result
    is empty only when no healthy worker serves the model."""
    serving = [w for w in workers if w.healthy and (request.model in w.models or w.serves(request))]
    in_window = [w for w in serving if w.max_model_len is None or request.total_tokens <= w.max_model_len]
    if not in_window:
        return _largest(serving, lambda w: w.max_model_len)
    fits = [w for w in in_window if w.kv_capacity_tokens is None or w.kv_capacity_tokens >= request.total_tokens]
    return fits or _largest(in_window, lambda w: w.kv_capacity_tokens)


def lacks_kv_room(request: RouteRequest, worker: WorkerView) -> bool:
    """Whether the worker's free KV cache (free blocks, those caching a prefix included: they are
    given up on demand) is known to be too small for the request now, so it waits for a running
    request to end."""
    return worker.free_kv_tokens is not None and worker.free_kv_tokens < request.total_tokens


def _largest(workers: list[WorkerView], size) -> list[WorkerView]:
    most = max((size(w) for w in workers), default=None)
    return [w for w in workers if size(w) == most]
