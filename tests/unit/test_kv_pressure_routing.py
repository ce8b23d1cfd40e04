"""Routing when workers' KV caches hold only a few conversations: the prefix index forgets a prompt
in the order a worker evicts it, remembers where prefixes went after it believes them evicted, and
measures each cache's eviction pressure; cost and cache_aware keep a prefix's requests together
under that pressure, and the balancer records a prompt again as its request ends."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from shoal.protocol.prefix_keys import canonical_chat, prefix_blocks
from shoal.protocol.worker_load import WorkerLoad
from shoal.router.config import HealthSettings
from shoal.router.fleet.health_events import HealthEvents
from shoal.router.fleet.membership import Membership
from shoal.router.placement.balancer import Balancer
from shoal.router.placement.policies import make_policy
from shoal.router.placement.policies.cache_aware import CacheAware
from shoal.router.placement.policies.cost import PRESSURE_MARGIN, CostPolicy, estimated_seconds
from shoal.router.placement.prefix_index import GHOST_FACTOR, PRESSURE_WINDOW, PrefixIndex
from shoal.router.views import RouteRequest, RoutingContext, WorkerView

SYSTEM = {"role": "system", "content": "You are an expert on sailing. Keep answers short and precise. " * 6}


def conversation(name: str) -> tuple[bytes, ...]:
    return prefix_blocks(canonical_chat([SYSTEM, {"role": "user", "content": f"{name}: tell me more " * 6}]).text)


def others(count: int) -> list[tuple[bytes, ...]]:
    """Prompts sharing nothing with SYSTEM's conversations."""
    return [prefix_blocks(f"unrelated prompt number {i} with its own words " * 8) for i in range(count)]


def worker(name: str, **fields) -> WorkerView:
    return WorkerView(**{"worker_id": name, "url": f"http://{name}", "models": frozenset({"m"}), **fields})


def test_the_index_forgets_a_prompt_tail_first_as_a_worker_evicts_it():
    """A worker frees a sequence's blocks tail first and evicts the least recently freed: of a
    prompt it keeps the shared head longest. An index holding half the prompt holds its head."""
    blocks = conversation("alice")
    system = len(prefix_blocks(canonical_chat([SYSTEM]).text))
    index = PrefixIndex()
    index.record("w", blocks, capacity_blocks=system)
    assert index.matched_blocks(blocks, ["w"]) == {"w": system}
    assert index.matched_blocks(conversation("bob"), ["w"])["w"] == system  # the shared system prompt


def test_prefixes_pushed_out_stay_placed_until_they_age_out():
    blocks, capacity = conversation("alice"), 40
    index = PrefixIndex()
    index.record("w", blocks, capacity)
    for other in others(4):
        index.record("w", other, capacity)
    assert index.matched_blocks(blocks, ["w", "v"]) == {"w": 0, "v": 0}
    assert index.placed_blocks(blocks, ["w", "v"]) == {"w": len(blocks), "v": 0}
    recorded = 0
    for other in others(200)[4:]:  # traffic that fits: nothing new is pushed out after the first
        index.record("w", other, capacity)
        recorded += len(other)
        if recorded > PRESSURE_WINDOW * capacity:
            break
    assert index.placed_blocks(blocks, ["w"]) == {"w": 0}
    index.record("w", blocks, capacity)
    assert index.placed_blocks(blocks, ["w"]) == index.matched_blocks(blocks, ["w"]) == {"w": len(blocks)}


def test_eviction_pressure_rises_with_traffic_a_cache_cannot_keep_and_falls_once_it_can():
    capacity = 20
    index = PrefixIndex()
    assert index.eviction_pressure("w") == 0.0
    for other in others(40):
        index.record("w", other, capacity)
    assert index.eviction_pressure("w") == GHOST_FACTOR  # pushed out as fast as sent, up to the cap
    steady = others(1)[0]  # blocks it holds: sent again and again, they push nothing out
    for _ in range(PRESSURE_WINDOW * capacity // len(steady) + 2):  # its first record pushes others out
        index.record("w", steady, capacity)
    assert index.eviction_pressure("w") == 0.0


def test_under_eviction_pressure_a_conversation_stays_home_where_the_noise_margin_would_move_it():
    """Home is estimated 50 % slower than an idle worker: with a cache that holds its traffic the
    conversation moves; with one sent twice what it could keep lately, the margin is 100 %."""
    req = RouteRequest(model="m", prompt_tokens=0, expected_decode_tokens=10)
    fleet = [
        worker("home", decode_step_s=0.075, single_step_s=0.075, capability=1000.0, decode_step_noise=0.01),
        worker("idle", decode_step_s=0.05, single_step_s=0.05, capability=1000.0, decode_step_noise=0.01),
    ]
    calm = RoutingContext(matched_blocks={"home": 4})
    assert estimated_seconds(req, fleet[0], fleet, calm) == pytest.approx(
        1.5 * estimated_seconds(req, fleet[1], fleet, calm)
    )
    assert CostPolicy().choose(req, fleet, calm).worker_id == "idle"
    pressed = RoutingContext(matched_blocks={"home": 4}, eviction_pressure=lambda worker_id: 2.0)
    assert 1 + PRESSURE_MARGIN * 2.0 >= 1.5
    assert CostPolicy().choose(req, fleet, pressed).worker_id == "home"


def test_where_no_worker_holds_the_prefix_it_goes_back_where_it_was_placed():
    req = RouteRequest(model="m", prompt_tokens=300, expected_decode_tokens=10, prefix_blocks=conversation("alice"))
    blocks = len(req.prefix_blocks)
    fleet = [worker("a", running=1), worker("b", running=1)]
    placed_on_b = RoutingContext(matched_blocks={"a": 0, "b": 0}, placed_blocks={"a": 0, "b": blocks})
    nowhere = RoutingContext(matched_blocks={"a": 0, "b": 0}, placed_blocks={"a": 0, "b": 0})
    assert CostPolicy().choose(req, fleet, nowhere).worker_id == "a"  # a tie: the first by name
    assert CostPolicy().choose(req, fleet, placed_on_b).worker_id == "b"
    assert CacheAware().choose(req, fleet, nowhere).worker_id == "a"
    assert CacheAware().choose(req, fleet, placed_on_b).worker_id == "b"


def test_a_prompt_is_recorded_again_as_its_request_ends_so_the_next_turn_finds_it():
    """While a turn runs the worker is sent other prompts that push it out of the index; the worker
    frees its blocks as it ends (its most recently freed, kept longest), and so does the index."""
    membership = Membership(HealthSettings(), HealthEvents(CollectorRegistry()))
    membership.register("http://w", ["m"], WorkerLoad(running=0, waiting=0, num_kv_blocks=4, block_size=16))
    balancer = Balancer(make_policy("cost"), membership)
    first = RouteRequest(model="m", prompt_tokens=30, expected_decode_tokens=5, prefix_blocks=conversation("alice"))
    turn = balancer.place(first)
    for other in others(3):
        balancer.release(
            balancer.place(RouteRequest(model="m", prompt_tokens=30, expected_decode_tokens=5, prefix_blocks=other))
        )
    assert balancer.prefix_index.matched_blocks(first.prefix_blocks, ["http://w"]) == {"http://w": 0}
    balancer.release(turn)
    assert balancer.prefix_index.matched_blocks(first.prefix_blocks, ["http://w"])["http://w"] > 0
