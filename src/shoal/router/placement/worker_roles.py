"""Where each phase of a request runs when a model has prefill and decode pools.

A request starts in the `prefill` phase: on a prefill or colocated worker. A continuation (after a
prefill worker's handoff, a drain, or a failover) is in the `decode` phase: on a decode or
colocated worker. Where no worker of the phase's roles can serve the model now, any worker of it
may (every role runs a whole engine): a P/D pool that lost its workers costs speed, never requests.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from shoal.router.views import RouteRequest, WorkerView

Phase = Literal["prefill", "decode"]
PHASE_ROLES: dict[Phase, frozenset[str]] = {
    "prefill": frozenset({"colocated", "prefill"}),
    "decode": frozenset({"colocated", "decode"}),
}


def for_phase(workers: Sequence[WorkerView], request: RouteRequest, phase: Phase) -> list[WorkerView]:
    """The workers of the phase's roles if one of them can serve the request now, else all of them."""
    roles = PHASE_ROLES[phase]
    preferred = [w for w in workers if w.role in roles]
    if any(w.healthy and w.serves(request) for w in preferred):
        return preferred
    return list(workers)


def decode_tokens_on(worker: WorkerView, expected_decode_tokens: int) -> int:
    """The tokens a worker is expected to generate for a request: a prefill worker only the first."""
    return min(1, expected_decode_tokens) if worker.role == "prefill" else expected_decode_tokens
