"""A request's latency targets: its `x-shoal-ttft-target-ms` and `x-shoal-tpot-target-ms` headers, else
its API key's targets, else its model's (router config). Each is placed where the cost model predicts
them met (policies.cost); sheddable work no worker can serve in time is refused at once; a request
that had targets counts as met or missed when it ends (goodput)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

from msgspec.structs import replace

from shoal.router.config import LatencyTargets
from shoal.router.placement.policies.cost import Estimate
from shoal.router.views import RouteRequest

TTFT_HEADER = "x-shoal-ttft-target-ms"
TPOT_HEADER = "x-shoal-tpot-target-ms"


class BadTarget(ValueError):
    """A target header that is not a positive number of milliseconds; `header` names it."""

    def __init__(self, header: str):
        super().__init__(f"{header} must be a positive number of milliseconds")
        self.header = header


def with_targets(routed: RouteRequest, headers: Mapping[str, str], *defaults: LatencyTargets) -> RouteRequest:
    """The request with its targets: each from its header, else the first of `defaults` (the key's,
    then the model's) that sets it. BadTarget for a header that is not a positive number."""
    ttft = _header_ms(headers, TTFT_HEADER) or next((d.ttft_ms for d in defaults if d.ttft_ms), None)
    tpot = _header_ms(headers, TPOT_HEADER) or next((d.tpot_ms for d in defaults if d.tpot_ms), None)
    if ttft is None and tpot is None:
        return routed
    return replace(
        routed,
        ttft_target_s=ttft / 1000 if ttft else None,
        tpot_target_s=tpot / 1000 if tpot else None,
    )


def _header_ms(headers: Mapping[str, str], header: str) -> float | None:
    value = headers.get(header)
    if value is None:
        return None
    try:
        milliseconds = float(value)
    except ValueError:
        raise BadTarget(header) from None
    if not math.isfinite(milliseconds) or milliseconds <= 0:
        raise BadTarget(header)
    return milliseconds


def met(routed: RouteRequest, ttft_s: float | None, tpot_s: float | None) -> bool:
    """Whether a request that ended with that first token and time per token met its targets."""
    if routed.ttft_target_s is not None and (ttft_s is None or ttft_s > routed.ttft_target_s):
        return False
    return routed.tpot_target_s is None or tpot_s is None or tpot_s <= routed.tpot_target_s


def late(routed: RouteRequest, best_estimate: Callable[[RouteRequest], Estimate | None]) -> str | None:
    """Why sheddable work with latency targets is refused now: by the best prediction for it
    (Balancer.best_estimate, asked only for such work), no worker is predicted to meet them, so it
    would be served late. None where it is not sheddable, has no targets, no worker could take it,
    or one meets them."""
    if routed.priority != "sheddable" or (routed.ttft_target_s is None and routed.tpot_target_s is None):
        return None
    best = best_estimate(routed)
    if best is None or best.meets(routed):
        return None
    return (
        f"no worker can meet this sheddable request's latency targets now (predicted at best: first "
        f"token in {best.ttft_s * 1000:.0f} ms, {best.tpot_s * 1000:.0f} ms a token); try again later"
    )
