"""Latency targets: where they come from (headers, then the key's, then the model's), the cost
model's predictions against them, placement where they are met at least cost, and whether a request
that ended met them."""

from __future__ import annotations

import pytest
from msgspec.structs import replace

from shoal.router.config import LatencyTargets
from shoal.router.placement.latency_targets import BadTarget, late, met, with_targets
from shoal.router.placement.policies.cost import CostPolicy, estimate
from shoal.router.views import RouteRequest, RoutingContext, WorkerView

SPEEDS = {"prefill_tokens_per_s": 1000.0, "decode_step_s": 0.02, "single_step_s": 0.02, "capability": 400.0}


def worker(name: str, **fields) -> WorkerView:
    return WorkerView(worker_id=name, url=f"http://{name}", models=frozenset({"m"}), **{**SPEEDS, **fields})


def test_targets_come_from_headers_then_the_key_then_the_model():
    request = RouteRequest("m", 100, 10)
    key, model = LatencyTargets(ttft_ms=500), LatencyTargets(ttft_ms=900, tpot_ms=50)
    assert with_targets(request, {}) is request
    both = with_targets(request, {}, key, model)
    assert (both.ttft_target_s, both.tpot_target_s) == (0.5, 0.05)
    header = with_targets(request, {"x-shoal-ttft-target-ms": "200"}, key, model)
    assert (header.ttft_target_s, header.tpot_target_s) == (0.2, 0.05)
    for bad in ("0", "-5", "soon", "nan", "inf"):
        with pytest.raises(BadTarget, match="x-shoal-tpot-target-ms must be a positive number"):
            with_targets(request, {"x-shoal-tpot-target-ms": bad})


def test_the_prediction_splits_into_time_to_first_token_and_per_token():
    request = RouteRequest("m", 500, 10)
    idle = estimate(request, worker("idle"), [worker("idle")], RoutingContext())
    assert idle.ttft_s == pytest.approx(0.5) and idle.tpot_s == pytest.approx(0.02)
    queued = worker("queued", outstanding_prefill_tokens=2000)
    behind = estimate(request, queued, [queued], RoutingContext())
    assert behind.ttft_s == pytest.approx(2.5)  # the prompts queued ahead, then its own
    assert behind.meets(replace(request, ttft_target_s=3.0)) and not behind.meets(replace(request, ttft_target_s=2.0))


def test_a_request_goes_where_its_targets_are_met_at_least_cost():
    """`cached` holds the prompt (cheapest in all) but has a queue ahead of it; `fresh` computes the
    prompt from scratch and gives the first token sooner."""
    request = RouteRequest("m", 1000, 200, prefix_blocks=tuple(bytes([i]) * 12 for i in range(125)))
    fleet = [worker("cached", outstanding_prefill_tokens=1500), worker("fresh")]
    context = RoutingContext(matched_blocks={"cached": 125, "fresh": 0})
    assert CostPolicy().choose(request, fleet, context).worker_id == "cached"
    hurried = replace(request, ttft_target_s=1.2)
    predicted = {w.worker_id: estimate(hurried, w, fleet, context) for w in fleet}
    assert not predicted["cached"].meets(hurried) and predicted["fresh"].meets(hurried)
    assert CostPolicy().choose(hurried, fleet, context).worker_id == "fresh"
    impossible = replace(request, ttft_target_s=0.01)  # met nowhere: placed as without targets
    assert CostPolicy().choose(impossible, fleet, context).worker_id == "cached"


def test_a_request_that_ended_met_its_targets_or_not():
    request = RouteRequest("m", 10, 10, ttft_target_s=0.5, tpot_target_s=0.05)
    assert met(request, 0.4, 0.04)
    assert not met(request, 0.6, 0.04) and not met(request, 0.4, 0.06) and not met(request, None, None)
    assert met(replace(request, tpot_target_s=None), 0.4, 1.0)


def test_sheddable_work_is_late_only_where_no_worker_is_predicted_to_meet_its_targets():
    request = RouteRequest("m", 500, 10, priority="sheddable", ttft_target_s=1.0)
    fast, slow = worker("fast"), worker("slow", outstanding_prefill_tokens=2000)
    context = RoutingContext()
    assert late(request, lambda r: estimate(r, fast, [fast, slow], context)) is None
    reason = late(request, lambda r: estimate(r, slow, [fast, slow], context))
    assert reason.startswith("no worker can meet this sheddable request's latency targets now")
    assert "first token in 2500 ms" in reason
    assert late(replace(request, priority="standard"), lambda r: estimate(r, slow, [slow], context)) is None
    assert late(replace(request, ttft_target_s=None), lambda r: estimate(r, slow, [slow], context)) is None
    assert late(request, lambda r: None) is None  # no worker could take it: not a question of time
