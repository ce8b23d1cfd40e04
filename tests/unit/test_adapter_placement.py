"""Placement of requests for LoRA adapters: which workers may take them (those serving the adapter,
and, for an adapter a router loads on demand, every worker of its base that reads adapters at run
time), what a worker that does not hold the adapter in memory is charged (its measured read), and
that a holder keeps the adapter's requests unless it is busier than a read and the noise margin."""

from __future__ import annotations

import asyncio
import json

import pytest
from msgspec.structs import replace
from prometheus_client import CollectorRegistry

from shoal.protocol.prefix_keys import prefix_blocks, salted_blocks
from shoal.router.config import HealthSettings
from shoal.router.fleet.health_events import HealthEvents
from shoal.router.fleet.membership import Membership
from shoal.router.placement.policies import eligible
from shoal.router.placement.policies.cost import DEFAULT_ADAPTER_LOAD_S, CostPolicy, adapter_seconds, estimated_seconds
from shoal.router.views import RouteRequest, RoutingContext, WorkerView

FAST = {"decode_step_s": 0.02, "single_step_s": 0.02, "capability": 400.0, "decode_step_noise": 0.01}


def worker(name: str, models=("base",), **fields) -> WorkerView:
    return WorkerView(worker_id=name, url=f"http://{name}", models=frozenset(models), **{**FAST, **fields})


def adapter_request(loadable: bool = True, **fields) -> RouteRequest:
    return RouteRequest("a1", 50, 20, adapter_of="base", adapter_loadable=loadable, **fields)


def test_an_adapter_loaded_on_demand_may_go_to_any_worker_of_its_base_that_reads_adapters():
    fleet = [
        worker("holds", models=("base", "a1"), lora_held=frozenset({"a1"})),
        worker("reads", lora_on_demand=True),
        worker("fixed"),  # no lora_dir: serves only what it was started with
        worker("other", models=("other-base",), lora_on_demand=True),
    ]
    assert {w.worker_id for w in eligible(adapter_request(), fleet)} == {"holds", "reads"}
    assert {w.worker_id for w in eligible(adapter_request(loadable=False), fleet)} == {"holds"}
    assert {w.worker_id for w in eligible(RouteRequest("base", 50, 20), fleet)} == {"holds", "reads", "fixed"}


def test_a_worker_not_holding_the_adapter_is_charged_its_read():
    request, fleet = (
        adapter_request(),
        [
            worker("holds", models=("base", "a1"), lora_held=frozenset({"a1"}), lora_load_s=0.3),
            worker("known", models=("base", "a1"), lora_load_s=0.2),  # given back past max_cpu_loras
            worker("new", lora_on_demand=True),
        ],
    )
    assert adapter_seconds(request, fleet[0], fleet) == 0.0
    assert adapter_seconds(request, fleet[1], fleet) == 0.2
    assert adapter_seconds(request, fleet[2], fleet) == pytest.approx(0.25)  # the fleet's median
    assert adapter_seconds(RouteRequest("base", 50, 20), fleet[2], fleet) == 0.0
    full = worker("full", lora_on_demand=True, lora_load_s=0.2, lora_held=frozenset({"x", "y"}), lora_capacity=2)
    assert adapter_seconds(request, full, fleet) == 0.4  # and the one it gives back is read again later
    assert adapter_seconds(request, replace(full, lora_capacity=3), fleet) == 0.2
    lone = [worker("new", lora_on_demand=True)]
    assert adapter_seconds(request, lone[0], lone) == DEFAULT_ADAPTER_LOAD_S
    context = RoutingContext()
    gap = estimated_seconds(request, fleet[2], fleet, context) - estimated_seconds(request, fleet[0], fleet, context)
    assert gap == pytest.approx(0.25)


def test_the_holder_keeps_the_adapter_until_it_is_busier_than_a_read_and_the_margin():
    request = adapter_request()
    idle_holder = worker("holds", models=("base", "a1"), lora_held=frozenset({"a1"}), lora_load_s=0.001)
    loader = worker("loads", lora_on_demand=True, lora_load_s=0.001)
    # Slower by 5 % (noise) and a read costs next to nothing: the adapter stays where it is hot.
    slower_holder = replace(idle_holder, decode_step_s=0.021, single_step_s=0.021)
    assert CostPolicy().choose(request, [slower_holder, loader], RoutingContext()).worker_id == "holds"
    # Full (max_num_seqs) with long requests queued ahead: the read is far cheaper than the wait.
    busy_holder = replace(idle_holder, running=4, max_num_seqs=4, outstanding_decode_tokens=800)
    assert CostPolicy().choose(request, [busy_holder, loader], RoutingContext()).worker_id == "loads"


def test_an_adapters_prefixes_are_its_own():
    blocks = prefix_blocks("the same system prompt for every fine-tune of the base model " * 4)
    a1, a2 = salted_blocks(blocks, "a1"), salted_blocks(blocks, "a2")
    assert len(a1) == len(blocks) and not set(a1) & set(blocks) and not set(a1) & set(a2)
    longer = salted_blocks(prefix_blocks("the same system prompt for every fine-tune of the base model " * 6), "a1")
    assert longer[: len(a1)] == a1  # still a chain: a longer prompt extends the shorter one's blocks


def test_a_server_listing_lora_adapters_as_models_with_a_parent_serves_them():
    """vLLM lists its LoRA adapters in /v1/models with the base model as `parent`: they are served
    there (requests for them may go there), not base models of their own."""
    membership = Membership(HealthSettings(), HealthEvents(CollectorRegistry()))

    async def listing(url: str) -> tuple[int, bytes]:
        assert url == "http://peer/v1/models"
        return 200, json.dumps({"data": [{"id": "base"}, {"id": "sql-lora", "parent": "base"}]}).encode()

    membership._get = listing
    state = membership.workers["http://peer"] = membership._new_state("http://peer", frozenset(), registered=False)
    asyncio.run(membership._discover_models(state))
    assert state.base_models == {"base"} and state.models == {"base", "sql-lora"}
    assert membership.adapter_base("sql-lora") == "base" and membership.adapter_base("base") is None
    assert state.serves("sql-lora") and not state.serves("other")
