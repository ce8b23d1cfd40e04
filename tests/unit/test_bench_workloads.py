"""`shoal bench`'s pure parts: seeded workload generators, arrival processes, length distributions
and the statistics of records."""

from __future__ import annotations

import random

import pytest

from shoal.bench.arrivals import ArrivalProcess
from shoal.bench.lengths import Fixed, Normal, Uniform, parse_length
from shoal.bench.records import RequestRecord
from shoal.bench.stats import SLO, Distribution, summarize
from shoal.bench.text import MESSAGE_OVERHEAD_TOKENS
from shoal.bench.workloads import WorkloadConfig, build_workload, with_answers
from shoal.percentile import percentile

CLOSED = ArrivalProcess("closed", concurrency=4)
KINDS = ["synthetic", "multi-turn", "long-prompt"]


def workload(kind: str, requests: int = 30, arrivals: ArrivalProcess = CLOSED, **options):
    options = {
        "prompt_tokens": Uniform(5, 40),
        "output_tokens": Uniform(4, 16),
        "long_prompt_tokens": Fixed(500),
        "system_prompt_tokens": 20,
        "turns": 3,
        **options,
    }
    return build_workload(WorkloadConfig(kind, requests, **options), arrivals)


@pytest.mark.parametrize("kind", KINDS)
def test_the_same_seed_gives_the_same_requests_and_another_seed_others(kind):
    assert workload(kind, seed=7) == workload(kind, seed=7)
    assert [r.messages for r in workload(kind, seed=7)] != [r.messages for r in workload(kind, seed=8)]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("requests", [1, 7, 30])
def test_a_workload_has_the_requests_asked_for_in_order_of_arrival(kind, requests):
    got = workload(kind, requests, ArrivalProcess("poisson", rate=10.0))
    assert len(got) == requests
    assert [r.index for r in got] == list(range(requests))
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(got, got[1:]))
    assert all(4 <= r.max_tokens <= 16 and r.messages[-1]["role"] == "user" for r in got)


def test_the_arrival_process_changes_the_times_but_not_the_prompts():
    closed = workload("synthetic")
    poisson = workload("synthetic", arrivals=ArrivalProcess("poisson", rate=3.0))
    assert [r.messages for r in closed] == [r.messages for r in poisson]
    assert [r.arrival_s for r in closed] != [r.arrival_s for r in poisson]


def test_prompt_token_estimates_follow_the_asked_lengths():
    got = workload("synthetic", prompt_tokens=Fixed(50), system_prompt_tokens=0)
    assert {r.prompt_tokens for r in got} == {50 + MESSAGE_OVERHEAD_TOKENS}
    assert all(len(r.messages[0]["content"].split()) == 50 for r in got)


def test_poisson_arrivals_have_the_asked_mean_rate():
    times = ArrivalProcess("poisson", rate=5.0).times(20_000, random.Random(1))
    assert times[0] == 0.0
    assert 4.75 < (len(times) - 1) / times[-1] < 5.25
    gaps = sorted(b - a for a, b in zip(times, times[1:]))
    assert gaps[0] < 0.01 and gaps[-1] > 1.0  # spread out as exponential gaps are, not even


def test_fixed_rate_arrivals_are_evenly_spaced_and_a_closed_loop_starts_all_at_once():
    assert ArrivalProcess("fixed", rate=4.0).times(5, random.Random(0)) == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert ArrivalProcess("closed", concurrency=2).times(3, random.Random(0)) == [0.0, 0.0, 0.0]


@pytest.mark.parametrize(
    "kind,rate,concurrency",
    [("poisson", None, None), ("fixed", 0.0, None), ("closed", None, None), ("poisson", 1.0, 0), ("burst", 1.0, 1)],
)
def test_arrival_processes_refuse_missing_or_bad_values(kind, rate, concurrency):
    with pytest.raises(ValueError):
        ArrivalProcess(kind, rate, concurrency)


def test_multi_turn_conversations_share_the_system_prompt_and_each_turn_extends_the_last():
    got = workload("multi-turn", requests=12, turns=3)
    assert len({r.conversation_id for r in got}) == 4
    assert len({r.messages[0]["content"] for r in got}) == 1 and got[0].messages[0]["role"] == "system"
    for conversation in range(4):
        turns = [r for r in got if r.conversation_id == conversation]
        assert [r.turn for r in turns] == [0, 1, 2]
        for before, after in zip(turns, turns[1:]):
            assert after.messages[: len(before.messages)] == before.messages
            assert [m["role"] for m in after.messages[len(before.messages) :]] == ["assistant", "user"]
            assert after.prompt_tokens > before.prompt_tokens and after.arrival_s >= before.arrival_s
    assert [r.turn for r in got] == [0] * 4 + [1] * 4 + [2] * 4  # every first turn, then every second, ...


def test_multi_turn_cuts_the_last_turns_to_give_the_asked_count():
    got = workload("multi-turn", requests=7, turns=3)
    assert sorted((r.conversation_id, r.turn) for r in got) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1)]


def test_with_answers_puts_the_real_answers_in_place_of_the_generated_ones():
    turn = workload("multi-turn", requests=6, turns=2)[4]  # conversation 1, turn 1
    assert (turn.conversation_id, turn.turn) == (1, 1)
    messages = with_answers(turn.messages, ["the real answer"])
    assert [m["content"] for m in messages if m["role"] == "assistant"] == ["the real answer"]
    assert [m for m in messages if m["role"] != "assistant"] == [m for m in turn.messages if m["role"] != "assistant"]
    with pytest.raises(ValueError):
        with_answers(turn.messages, [])


@pytest.mark.parametrize("fraction", [0.0, 0.25, 1.0])
def test_the_long_prompt_mix_has_exactly_the_asked_fraction_of_long_prompts(fraction):
    got = workload("long-prompt", requests=200, long_fraction=fraction, system_prompt_tokens=0)
    long = [r for r in got if r.prompt_tokens >= 500]
    assert len(long) == round(fraction * 200)
    assert all(r.prompt_tokens <= 40 + MESSAGE_OVERHEAD_TOKENS for r in got if r not in long)


def test_length_distributions_stay_in_range_and_parse_their_own_text():
    rng = random.Random(3)
    assert {Fixed(9).sample(rng) for _ in range(10)} == {9}
    assert {Uniform(3, 5).sample(rng) for _ in range(200)} == {3, 4, 5}
    normal = [Normal(20, 8).sample(rng) for _ in range(5000)]
    assert min(normal) >= 1 and max(normal) <= 39 and 19 < sum(normal) / len(normal) < 21
    for text in ["128", "64:256", "128~32", "1.5~0.5"]:
        assert str(parse_length(text)) == text
    assert parse_length("64 : 256") == Uniform(64, 256)


@pytest.mark.parametrize("text", ["", "0", "abc", "5:2", "0:3", "-3~1", "10~-1", "1:2:3"])
def test_bad_lengths_are_refused(text):
    with pytest.raises(ValueError):
        parse_length(text)


@pytest.mark.parametrize(
    "options", [{"requests": 0}, {"turns": 0}, {"long_fraction": 1.5}, {"system_prompt_tokens": -1}, {"kind": "chaos"}]
)
def test_workload_configs_refuse_bad_values(options):
    with pytest.raises(ValueError):
        WorkloadConfig(**{"kind": "synthetic", "requests": 5, **options})


def record(
    index: int,
    ttft: float | None = 10.0,
    itl: tuple[float, ...] = (2.0, 3.0),
    e2e: float | None = 20.0,
    tokens: int = 3,
    error: str | None = None,
    status: int | None = 200,
) -> RequestRecord:
    return RequestRecord(
        index=index,
        conversation_id=index,
        turn=0,
        arrival_s=0.0,
        start_s=0.0,
        ttft_ms=ttft,
        itl_ms=itl,
        e2e_ms=None if error else e2e,
        prompt_tokens=5,
        completion_tokens=tokens,
        status=status,
        error=error,
    )


def test_percentiles_interpolate_and_are_ordered():
    assert percentile([5, 1, 3, 2, 4], 50) == 3
    assert percentile([1, 2, 3, 4, 5], 0) == 1 and percentile([1, 2, 3, 4, 5], 100) == 5
    assert percentile([10, 20], 90) == pytest.approx(19)
    assert percentile([], 50) is None and Distribution.of([]) is None
    with pytest.raises(ValueError, match="within 0 and 100"):
        percentile([1.0], 101)
    values = [random.Random(5).expovariate(1.0) for _ in range(1000)]
    d = Distribution.of(values)
    assert d.count == 1000 and d.p50 <= d.p90 <= d.p95 <= d.p99 <= max(values)


def test_no_records_give_zeros_not_errors():
    summary = summarize([], duration_s=0.0, slo=SLO(ttft_ms=1))
    assert (summary.total, summary.request_throughput, summary.goodput, summary.good_fraction) == (0, 0.0, 0.0, 0.0)
    assert summary.ttft_ms is None and summary.itl_ms is None and summary.errors == {}


def test_the_summary_counts_completed_requests_and_goodput_only_those_within_every_slo():
    records = [
        record(0),
        record(1, ttft=50.0),
        record(2, itl=(2.0, 40.0)),
        record(3, e2e=500.0),
        record(4, error="boom", status=500, tokens=1),
        record(5, error="connection refused", status=None),
    ]
    summary = summarize(records, duration_s=2.0, slo=SLO(ttft_ms=20, itl_ms=30, e2e_ms=100))
    assert (summary.total, summary.completed, summary.failed) == (6, 4, 2)
    assert summary.completion_tokens == 12 and summary.output_throughput == 6.0
    assert summary.request_throughput == 2.0
    assert summary.good == 1 and summary.goodput == 0.5 and summary.good_fraction == pytest.approx(1 / 6)
    assert summary.itl_ms.count == 8 and summary.ttft_ms.count == 4
    assert summary.errors == {"HTTP 500: boom": 1, "no response: connection refused": 1}
    assert summarize(records, 2.0).good == 4  # without an SLO every completed request is good


def test_errors_that_differ_only_in_numbers_are_one_kind():
    records = [record(i, error=f"prompt has {100 + i} tokens", status=400) for i in range(3)]
    assert summarize(records, 1.0).errors == {"HTTP 400: prompt has 100 tokens": 3}
