"""What a prefix hit in a worker's KV tier costs: its blocks are copied back into the paged cache
instead of computed, at the load rate the worker measured (until it has measured one, a guess of
TIER_SPEEDUP_GUESS times its prefill rate). A paged-cache hit costs nothing; a tier hit costs that
copy; a miss costs the prefill."""

from __future__ import annotations

from shoal.router.views import RouteRequest, RoutingContext, WorkerView

TIER_SPEEDUP_GUESS = 10.0


def tier_load_tokens_per_s(worker: WorkerView, prefill_tokens_per_s: float) -> float:
    return worker.kv_tier_load_tokens_per_s or TIER_SPEEDUP_GUESS * prefill_tokens_per_s


def tier_seconds(
    request: RouteRequest, worker: WorkerView, context: RoutingContext, prefill_tokens_per_s: float
) -> float:
    """Seconds to copy back the request's prefix tokens that lie in the worker's tier."""
    tokens = context.tier_tokens(request, worker)
    return tokens / tier_load_tokens_per_s(worker, prefill_tokens_per_s) if tokens else 0.0


def effective_matched_blocks(worker: WorkerView, context: RoutingContext, prefill_tokens_per_s: float) -> float:
    """Matched blocks, each tier block counted at the share of its prefill it saves."""
    matched = context.matched_blocks.get(worker.worker_id, 0)
    in_tier = context.tier_blocks.get(worker.worker_id, 0)
    if not in_tier:
        return matched
    saved = max(0.0, 1.0 - prefill_tokens_per_s / tier_load_tokens_per_s(worker, prefill_tokens_per_s))
    return matched - in_tier * (1.0 - saved)
