"""`shoal simulate` runs: the router's policies over simulated workers, end to end in simulated time."""

from __future__ import annotations

import pytest

from shoal.bench.arrivals import ArrivalProcess
from shoal.bench.lengths import Fixed, Uniform
from shoal.bench.text import MESSAGE_OVERHEAD_TOKENS
from shoal.bench.workloads import WorkloadConfig
from shoal.router.views import WorkerView
from shoal.simulate.calibration import WorkerFigures
from shoal.simulate.cost_model import CalibrationFigures, StepCost
from shoal.simulate.fleet import FleetSpec, WorkerClass, parse_mix
from shoal.simulate.membership import CachedMembership
from shoal.simulate.router import SHED, RouterSettings
from shoal.simulate.simulation import SimulationConfig, simulate

# Steps cost max(0.1 s, tokens x 1 ms) + 10 ms per decoding sequence.
FIGURES = WorkerFigures(
    CalibrationFigures(
        prefill_tokens_per_s=1000.0, decode_tokens_per_s=1 / 0.11, batched_decode_tokens_per_s=8 / 0.18, batch=8
    )
)
MULTI_TURN = WorkloadConfig("multi-turn", 60, Uniform(20, 80), Uniform(4, 24), system_prompt_tokens=64, turns=3)
POISSON_4 = ArrivalProcess("poisson", 4.0)


def config(
    workers: int = 3,
    workload: WorkloadConfig = MULTI_TURN,
    arrivals: ArrivalProcess = POISSON_4,
    policy: str = "cost",
    mix: str | None = None,
    seed: int = 0,
) -> SimulationConfig:
    fleet = FleetSpec(workers, parse_mix(mix)) if mix else FleetSpec(workers)
    return SimulationConfig(fleet, workload, arrivals, RouterSettings(policy=policy), FIGURES, seed)


def test_the_cost_model_of_these_tests_is_the_one_stated():
    cost = StepCost.from_calibration(FIGURES.calibration)
    assert (cost.floor_s, cost.token_s, cost.seq_s) == pytest.approx((0.1, 0.001, 0.01))


@pytest.mark.parametrize(
    "prompt_words, ttft_s",
    [
        (196, 0.2),  # one prefill step of 200 tokens: 200 x 1 ms
        (36, 0.1),  # 40 tokens: the step's floor
        (596, 0.512 + 0.1),  # 600 tokens: a 512-token chunk (the step budget), then 88 more
    ],
)
def test_a_lone_request_has_the_time_to_first_token_the_cost_model_gives(prompt_words, ttft_s):
    workload = WorkloadConfig("synthetic", 1, Fixed(prompt_words), Fixed(5))
    result = simulate(config(1, workload, ArrivalProcess("closed", concurrency=1)))
    (outcome,) = result.outcomes
    assert outcome.prompt_tokens == prompt_words + MESSAGE_OVERHEAD_TOKENS
    assert outcome.ttft_ms == pytest.approx(ttft_s * 1000)
    assert outcome.e2e_ms == pytest.approx((ttft_s + 4 * 0.11) * 1000)  # 4 decode steps of one sequence
    assert result.summary.cache_hit_rate == 0


def test_a_request_joins_the_running_batch_at_the_next_step():
    workload = WorkloadConfig("synthetic", 2, Fixed(96), Fixed(3))
    result = simulate(config(1, workload, ArrivalProcess("closed", concurrency=2)))
    # The first request starts a step alone (100 prompt tokens: the 100 ms floor); the second joins
    # the next one, which also decodes the first: max(0.1, 101 x 1 ms) + 10 ms. Then a decode step of
    # both (100 + 2 x 10 ms) ends the first; the second decodes its last token alone (100 + 10 ms).
    first, second = result.outcomes
    assert (first.ttft_ms, first.e2e_ms) == pytest.approx((100, 100 + 111 + 120))
    assert (second.ttft_ms, second.e2e_ms) == pytest.approx((211, 211 + 120 + 110))


def test_the_request_overhead_adds_to_every_request():
    workload = WorkloadConfig("synthetic", 2, Fixed(196), Fixed(1))
    config = SimulationConfig(
        FleetSpec(1), workload, ArrivalProcess("fixed", rate=1.0), RouterSettings(), FIGURES, request_overhead_s=0.05
    )
    assert [o.ttft_ms for o in simulate(config).outcomes] == pytest.approx([50 + 200, 50 + 200])


def test_the_same_config_gives_the_same_run_and_another_seed_another():
    first, again = simulate(config(policy="power_of_two")), simulate(config(policy="power_of_two"))
    assert first.outcomes == again.outcomes and first.summary == again.summary
    other = simulate(config(policy="power_of_two", seed=1))
    assert [o.worker_class for o in other.outcomes] == [o.worker_class for o in first.outcomes]
    assert other.outcomes != first.outcomes  # the router's random choices differ


@pytest.mark.parametrize(
    "policy", ["round_robin", "least_outstanding_tokens", "power_of_two", "cache_aware", "cost", "session_affinity"]
)
def test_every_request_has_one_outcome_and_the_figures_are_consistent(policy):
    result = simulate(config(policy=policy, mix="fast:1:speed=3;slow:2:kv=4096"))
    summary = result.summary
    assert [o.index for o in result.outcomes] == list(range(60))
    assert summary.completed + summary.failed == summary.total == 60
    assert summary.completed == 60 and not summary.errors
    for distribution in (summary.ttft_ms, summary.itl_ms, summary.e2e_ms):
        assert distribution.p50 <= distribution.p90 <= distribution.p95 <= distribution.p99
    assert summary.completion_tokens == sum(o.completion_tokens for o in result.outcomes)
    assert summary.output_throughput == pytest.approx(summary.completion_tokens / summary.duration_s)
    assert sum(summary.completed_by_class.values()) == 60
    for outcome in result.outcomes:
        assert outcome.arrival_s <= outcome.sent_s < outcome.first_token_s <= outcome.finished_s
        assert 0 <= outcome.cached_tokens < outcome.prompt_tokens


def test_a_conversation_turn_is_sent_only_after_the_previous_answer_and_concurrency_is_capped():
    result = simulate(config(arrivals=ArrivalProcess("closed", concurrency=4)))
    by_turn = {(o.conversation_id, o.turn): o for o in result.outcomes}
    for (conversation, turn), outcome in by_turn.items():
        if turn:
            assert outcome.sent_s >= by_turn[(conversation, turn - 1)].finished_s
    edges = sorted([(o.sent_s, 1) for o in result.outcomes] + [(o.finished_s, -1) for o in result.outcomes])
    in_flight = peak = 0
    for _, change in edges:
        in_flight += change
        peak = max(peak, in_flight)
    assert peak == 4


def test_later_turns_find_their_history_cached_and_cache_aware_routing_finds_more_than_round_robin():
    runs = {
        policy: simulate(config(6, policy=policy, arrivals=ArrivalProcess("poisson", 6.0)))
        for policy in ("round_robin", "cache_aware", "cost")
    }
    later_turns = [o for o in runs["cache_aware"].outcomes if o.turn > 0]
    assert all(o.cached_tokens > 64 for o in later_turns)  # at least the system prompt and turn 0
    assert runs["cache_aware"].summary.cache_hit_rate > runs["round_robin"].summary.cache_hit_rate + 0.2
    assert runs["cost"].summary.cache_hit_rate > runs["round_robin"].summary.cache_hit_rate + 0.2


def test_failed_workers_lose_work_and_their_requests_move_elsewhere():
    workload = WorkloadConfig("synthetic", 80, Uniform(100, 300), Fixed(60))
    result = simulate(config(4, workload, ArrivalProcess("poisson", 2.0), mix="flaky:1:mtbf=8,repair=3"))
    summary = result.summary
    assert summary.worker_failures > 0 and summary.migrations > 0
    assert summary.lost_tokens > 0 and 0 < summary.recomputed_tokens
    assert summary.completed + summary.failed == 80
    moved = [o for o in result.outcomes if o.migrations]
    assert moved and all(o.lost_tokens > 0 for o in moved)
    assert all(o.completion_tokens == 60 for o in moved if o.ok)


def test_requests_fail_when_every_worker_is_down_and_later_turns_are_not_sent():
    workload = WorkloadConfig("multi-turn", 30, Fixed(100), Fixed(200), system_prompt_tokens=0, turns=3)
    result = simulate(config(1, workload, ArrivalProcess("poisson", 1.0), mix="only:1:mtbf=5,repair=1000"))
    summary = result.summary
    assert summary.failed > 0 and summary.completed + summary.failed == 30
    assert any(error.startswith("not sent") for error in summary.errors)
    assert "no worker can take the request" in summary.errors or any("failed over" in e for e in summary.errors)


def test_the_cached_views_are_the_views_the_router_would_build(monkeypatch):
    original = CachedMembership.views
    checks = []

    def checked(self) -> list[WorkerView]:
        views = original(self)
        assert views == [state.view() for state in self.workers.values()]
        checks.append(len(views))
        return views

    monkeypatch.setattr(CachedMembership, "views", checked)
    simulate(config(5, mix="a:1:mtbf=10,repair=2;b:1:speed=2"))
    assert len(checks) >= 60


def test_a_worker_too_small_for_a_prompt_fails_that_request_only():
    workload = WorkloadConfig("long-prompt", 20, Fixed(50), Fixed(5), long_fraction=0.1, long_prompt_tokens=Fixed(3000))
    fleet = FleetSpec(2, (WorkerClass("small", 1, kv=2048),))
    result = simulate(SimulationConfig(fleet, workload, ArrivalProcess("poisson", 5.0), RouterSettings(), FIGURES))
    assert result.summary.failed == 2 and result.summary.completed == 18


def test_a_kv_tier_keeps_conversations_the_paged_cache_evicts_and_raises_the_hit_rate():
    """Workers whose paged cache holds a few conversations only: with a host-memory tier below it,
    later turns find their history there (copied back, not recomputed)."""
    small = "w:1:kv=1024"
    without = simulate(config(2, mix=small, policy="round_robin"))
    with_tier = simulate(config(2, mix=small + ",tier_host=200000", policy="round_robin"))
    assert with_tier.summary.cache_hit_rate > without.summary.cache_hit_rate + 0.1
    assert len(with_tier.outcomes) == len(without.outcomes)


def test_goodput_counts_the_requests_that_met_their_targets_and_sheddable_ones_are_refused_when_none_can():
    single = WorkloadConfig("synthetic", 40, Uniform(20, 200), Fixed(8))

    def run(ttft_ms: float, shed: float = 0.0, told: bool = True):
        settings = RouterSettings(ttft_target_ms=ttft_ms, tpot_target_ms=1000, sheddable_share=shed, read_targets=told)
        return simulate(SimulationConfig(FleetSpec(2), single, POISSON_4, settings, FIGURES)).summary, settings

    summary, _ = run(ttft_ms=1_000_000)
    assert summary.with_targets == summary.met_targets == summary.completed == 40
    assert summary.goodput == pytest.approx(40 / summary.duration_s)
    result = simulate(SimulationConfig(FleetSpec(2), single, POISSON_4, RouterSettings(ttft_target_ms=200), FIGURES))
    for outcome in result.outcomes:
        assert outcome.met_targets == (outcome.ttft_ms <= 200)
    assert 0 < result.summary.met_targets < 40
    # A first token in 1 ms is met nowhere: sheddable requests are refused at once, the others served late.
    summary, settings = run(ttft_ms=1, shed=0.5)
    assert summary.met_targets == 0 and summary.errors == {
        SHED: sum("x-shoal-priority" in settings.headers(i) for i in range(40))
    }
    assert 15 <= summary.errors[SHED] <= 25
    # Not told the targets, the router sheds nothing; they still score the requests.
    summary, _ = run(ttft_ms=1, shed=0.5, told=False)
    assert summary.completed == 40 and summary.with_targets == 40 and summary.met_targets == 0
