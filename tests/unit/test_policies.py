"""Routing policies on synthetic worker views: each routes as specified, and all respect the hard
constraints (model, health, context, KV capacity)."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from shoal.engine.speed import SpeedEstimator
from shoal.protocol.prefix_keys import canonical_chat, prefix_blocks
from shoal.router.placement.policies import POLICIES, eligible, make_policy
from shoal.router.placement.policies.cache_aware import CacheAware
from shoal.router.placement.policies.cost import CostPolicy, estimated_seconds
from shoal.router.placement.policies.session_affinity import SessionAffinity
from shoal.router.placement.prefix_index import PrefixIndex
from shoal.router.views import RouteRequest, RoutingContext, WorkerView

M = "m"


def worker(name: str, **fields) -> WorkerView:
    return WorkerView(**{"worker_id": name, "url": f"http://{name}", "models": frozenset({M}), **fields})


def request(prompt_tokens: int = 100, decode: int = 50, text: str = "", **fields) -> RouteRequest:
    return RouteRequest(
        model=M, prompt_tokens=prompt_tokens, expected_decode_tokens=decode, prefix_blocks=prefix_blocks(text), **fields
    )


def test_eligibility_filters_model_health_context_and_whole_cache_not_free_room():
    workers = [
        worker("sick", healthy=False),
        worker("other", models=frozenset({"x"})),
        worker("short", max_model_len=100),
        worker("small", free_kv_tokens=50, kv_capacity_tokens=50),
        worker("full", free_kv_tokens=10, kv_capacity_tokens=10_000),
        worker("roomy", free_kv_tokens=5_000, kv_capacity_tokens=10_000),
    ]
    # "full" queues the request until a running one ends: whether its cache is worth the wait is
    # the policy's to weigh.
    assert [w.worker_id for w in eligible(request(), workers)] == ["full", "roomy"]


def test_cost_counts_the_wait_for_kv_room_like_the_wait_for_a_batch_slot():
    running = dict(running=2, outstanding_decode_tokens=200, decode_step_s=0.02, prefill_tokens_per_s=1000.0)
    roomy = worker("roomy", free_kv_tokens=5_000, kv_capacity_tokens=10_000, **running)
    full = worker("full", free_kv_tokens=10, kv_capacity_tokens=10_000, **running)
    fleet = [roomy, full]
    per_token = 0.02  # the step while two run, above (2 + 1) / the default decode rate's share
    waited = estimated_seconds(request(), full, fleet, RoutingContext()) - estimated_seconds(
        request(), roomy, fleet, RoutingContext()
    )
    assert waited == pytest.approx(200 / 2 * max(per_token, 3 / 100.0))


def test_a_request_too_long_by_estimate_for_every_worker_goes_to_the_largest_which_counts_exactly():
    windows = [worker("short", max_model_len=100), worker("long", max_model_len=120), worker("sick", healthy=False)]
    assert [w.worker_id for w in eligible(request(prompt_tokens=500), windows)] == ["long"]
    caches = [
        worker("small", free_kv_tokens=0, kv_capacity_tokens=50),
        worker("big", free_kv_tokens=0, kv_capacity_tokens=80),
    ]
    assert [w.worker_id for w in eligible(request(prompt_tokens=500), caches)] == ["big"]
    assert eligible(request(), [worker("sick", healthy=False), worker("other", models=frozenset({"x"}))]) == []


def test_round_robin_cycles():
    policy = make_policy("round_robin")
    workers = [worker("a"), worker("b"), worker("c")]
    picks = [policy.choose(request(), workers, RoutingContext(sequence_number=i)).worker_id for i in range(6)]
    assert picks == ["a", "b", "c", "a", "b", "c"]


def test_least_outstanding_tokens_picks_the_least_work():
    workers = [
        worker("a", outstanding_decode_tokens=500),
        worker("b", outstanding_prefill_tokens=100),
        worker("c", outstanding_decode_tokens=300),
    ]
    assert make_policy("least_outstanding_tokens").choose(request(), workers, RoutingContext()).worker_id == "b"


def test_power_of_two_never_picks_the_worst_of_its_pair():
    workers = [worker(str(i), outstanding_decode_tokens=100 * i) for i in range(5)]
    policy = make_policy("power_of_two")
    rng = random.Random(1)
    picks = Counter(policy.choose(request(), workers, RoutingContext(rng=rng)).worker_id for _ in range(500))
    assert "4" not in picks and picks["0"] > picks["3"]


def test_cost_policy_sends_about_twice_the_work_to_a_twice_as_fast_worker():
    """Simulated continuous batching under saturating load (357 tokens/s asked of 300 available):
    every tick one request of 50 tokens arrives; each worker decodes its running requests at
    min(1 / step time, aggregate rate / batch) tokens/s each."""
    speed = {"fast": 2.0, "slow": 1.0}
    active: dict[str, list[float]] = {n: [] for n in speed}
    counts = Counter()
    policy, tick_s = CostPolicy(), 0.14
    for _ in range(400):
        views = [
            worker(
                n,
                running=len(active[n]),
                outstanding_decode_tokens=int(sum(active[n])),
                capability=100 * speed[n],
                decode_step_s=0.02 / speed[n],
                prefill_tokens_per_s=1000 * speed[n],
            )
            for n in speed
        ]
        chosen = policy.choose(request(decode=50), views, RoutingContext()).worker_id
        counts[chosen] += 1
        active[chosen].append(50.0)
        for n, running in active.items():
            if running:
                each = tick_s * min(speed[n] / 0.02, 100 * speed[n] / len(running))
                active[n] = [r - each for r in running if r > each]
    assert 1.6 < counts["fast"] / counts["slow"] < 2.5, counts


def test_cost_policy_counts_only_uncached_prefill_and_prefers_fast_prefill_for_long_prompts():
    text = "shared system prompt " * 40
    req = request(prompt_tokens=2000, decode=10, text=text)
    a, b = worker("a"), worker("b")
    context = RoutingContext(matched_blocks={"a": len(req.prefix_blocks), "b": 0})
    assert estimated_seconds(req, a, [a, b], context) < estimated_seconds(req, b, [a, b], context)
    assert CostPolicy().choose(req, [a, b], context).worker_id == "a"
    fast_prefill = worker("p", prefill_tokens_per_s=10_000, capability=100)
    slow_prefill = worker("q", prefill_tokens_per_s=500, capability=150)
    assert CostPolicy().choose(req, [fast_prefill, slow_prefill], RoutingContext()).worker_id == "p"


def test_a_prefill_is_charged_the_delay_it_puts_on_the_streams_running_beside_it():
    """A new conversation whose 600-token system prompt one busy worker holds: its 300 new tokens
    there would stall six running streams for 0.3 s each, more than the idle worker's whole prefill
    costs, so it goes to the idle one. With nothing running on the holder, the holder keeps it."""
    req = request(prompt_tokens=900, decode=100)
    speeds = dict(capability=172.0, decode_step_s=0.045, single_step_s=0.042, prefill_tokens_per_s=1000.0)
    busy, idle = worker("busy", running=6, **speeds), worker("idle", **speeds)
    context = RoutingContext(matched_blocks={"busy": 600 * 4 // 32, "idle": 0})  # 32 characters, 4 a token
    assert context.cached_tokens(req, busy) == 600
    assert estimated_seconds(req, busy, [busy, idle], context) == pytest.approx(0.3 + 100 * 0.045 + 6 * 0.3)
    assert CostPolicy().choose(req, [busy, idle], context).worker_id == "idle"
    quiet = worker("busy", **speeds)
    assert CostPolicy().choose(req, [quiet, idle], context).worker_id == "busy"


def test_a_server_that_reports_no_load_is_charged_the_queue_it_has_shown():
    """A server seen serving one request at a time, 4 s a request, with two of the router's requests
    on it: a third waits two service times, and goes to a busy batching worker instead. One that has
    been seen serving four at once takes it beside its two, at the batch's per-token time."""
    req = request(prompt_tokens=0, decode=10)
    speeds = dict(capability=100.0, decode_step_s=0.05, single_step_s=0.05, prefill_tokens_per_s=1000.0)
    serial = worker("serial", in_flight=2, served_concurrency=1, service_s=4.0, **speeds)
    batching = worker("batching", running=6, **speeds)
    fleet = [serial, batching]
    assert estimated_seconds(req, serial, fleet, RoutingContext()) == pytest.approx(2 * 4.0 + 10 * 0.05)
    assert CostPolicy().choose(req, fleet, RoutingContext()).worker_id == "batching"
    shown_four = worker("serial", in_flight=2, served_concurrency=4, service_s=4.0, **speeds)
    assert estimated_seconds(req, shown_four, fleet, RoutingContext()) == pytest.approx(10 * 0.05)
    assert CostPolicy().choose(req, [shown_four, batching], RoutingContext()).worker_id == "serial"
    # before any request has ended there, the wait is this request's own estimate a turn, or what
    # the oldest there has taken so far if longer
    unmeasured = worker("serial", in_flight=1, served_concurrency=1, busy_s=0.1, **speeds)
    assert estimated_seconds(req, unmeasured, fleet, RoutingContext()) == pytest.approx(2 * 10 * 0.05)
    slow_so_far = worker("serial", in_flight=1, served_concurrency=1, busy_s=6.0, service_s=4.0, **speeds)
    assert estimated_seconds(req, slow_so_far, fleet, RoutingContext()) == pytest.approx(6.0 + 10 * 0.05)


def test_a_server_that_has_ended_no_stream_yet_gets_a_second_request_only_when_all_would_queue_blind():
    """An opening burst: a serial server with one request and none ended would be estimated at its
    own estimate a turn (1 s), less than a batching worker with thirty streams (3.1 s), but how long
    that turn really takes is unknown, so the batching worker takes it, home prefix or not. Once the
    server has ended a request it is priced by what it took. When every worker would queue blind,
    the estimates decide."""
    req = request(prompt_tokens=0, decode=10)
    speeds = dict(capability=100.0, decode_step_s=0.05, single_step_s=0.05, prefill_tokens_per_s=1000.0)
    blind = worker("serial", in_flight=1, served_concurrency=1, **speeds)
    batching = worker("batching", running=30, **speeds)
    assert estimated_seconds(req, blind, [blind, batching], RoutingContext()) == pytest.approx(2 * 10 * 0.05)
    assert estimated_seconds(req, batching, [blind, batching], RoutingContext()) == pytest.approx(10 * 31 / 100.0)
    assert CostPolicy().choose(req, [blind, batching], RoutingContext()).worker_id == "batching"
    holding_prefix = RoutingContext(matched_blocks={"serial": 3})
    assert CostPolicy().choose(req, [blind, batching], holding_prefix).worker_id == "batching"
    measured = worker("serial", in_flight=1, served_concurrency=1, service_s=0.5, **speeds)
    assert CostPolicy().choose(req, [measured, batching], RoutingContext()).worker_id == "serial"
    idle = worker("serial", served_concurrency=1, **speeds)
    assert CostPolicy().choose(req, [idle, batching], RoutingContext()).worker_id == "serial"
    deeper = worker("other", in_flight=2, served_concurrency=1, **speeds)
    assert CostPolicy().choose(req, [deeper, blind], RoutingContext()).worker_id == "serial"


def test_a_conversation_stays_home_by_a_margin_as_wide_as_the_two_workers_step_noise():
    """Home holds the history but is estimated 20 % slower than an idle worker. Workers whose steps
    are steady (3 % each: margin 10 %) move it; noisy ones (12 % each: 24 %) keep it home, as do
    workers that do not report their noise (12.5 % each is taken: 25 %)."""
    req = request(prompt_tokens=0, decode=10)
    context = RoutingContext(matched_blocks={"home": 4})

    def fleet(noise: float | None) -> list:
        return [
            worker("home", decode_step_s=0.06, single_step_s=0.06, capability=1000.0, decode_step_noise=noise),
            worker("idle", decode_step_s=0.05, single_step_s=0.05, capability=1000.0, decode_step_noise=noise),
        ]

    steady = fleet(0.03)
    assert estimated_seconds(req, steady[0], steady, context) == pytest.approx(
        1.2 * estimated_seconds(req, steady[1], steady, context)
    )
    assert CostPolicy().choose(req, steady, context).worker_id == "idle"
    assert CostPolicy().choose(req, fleet(0.12), context).worker_id == "home"
    assert CostPolicy().choose(req, fleet(None), context).worker_id == "home"
    assert CostPolicy(min_affinity_margin=0.5).choose(req, steady, context).worker_id == "home"


def test_a_worker_that_reports_no_speeds_borrows_the_fleets_idle_step_not_its_loaded_one():
    """A vLLM server (load from its metrics, no speeds) idle beside a shoal worker running twelve
    streams at 100 ms a step that holds the request's prefix: the server is costed at shoal's idle
    step (20 ms), not at its loaded one, so it takes the request despite the affinity margin."""
    req = request(prompt_tokens=40, decode=64)
    busy = worker("shoal", running=12, single_step_s=0.02, decode_step_s=0.1, capability=300.0)
    unknown = worker("vllm")
    context = RoutingContext(matched_blocks={"shoal": 5})
    assert estimated_seconds(req, unknown, [busy, unknown], context) == pytest.approx(40 / 1000.0 + 64 * 0.02)
    assert CostPolicy().choose(req, [busy, unknown], context).worker_id == "vllm"


def test_an_idle_worker_is_costed_by_the_shorter_of_its_calibrated_and_last_measured_steps():
    """The last step measured under load is stale for an idle worker (longer than a single-stream
    step), a calibration measured on a starved CPU is stale the other way; neither makes it look slower."""
    req, fleet = request(prompt_tokens=0, decode=10), [worker("peer")]
    after_load = worker("w", single_step_s=0.02, decode_step_s=0.1, capability=1000.0)
    after_starved_start = worker("w", single_step_s=0.1, decode_step_s=0.02, capability=1000.0)
    for idle in (after_load, after_starved_start):
        assert estimated_seconds(req, idle, fleet, RoutingContext()) == pytest.approx(10 * 0.02)
    busy = worker("w", running=1, single_step_s=0.02, decode_step_s=0.1, capability=1000.0)
    assert estimated_seconds(req, busy, fleet, RoutingContext()) == pytest.approx(10 * 0.1)


def test_measured_figures_within_the_noise_of_a_shared_machine_leave_the_calibration_in_charge():
    """Identical idle workers whose last steps differ by noise cost the same, so a conversation is
    not traded away from its cache on luck."""
    req, fleet = request(prompt_tokens=0, decode=10), [worker("peer")]
    lucky = worker("a", single_step_s=0.02, decode_step_s=0.015, capability=1000.0, decode_tokens_per_s=1500.0)
    unlucky = worker("b", single_step_s=0.02, decode_step_s=0.03, capability=1000.0, decode_tokens_per_s=700.0)
    assert (
        estimated_seconds(req, lucky, fleet, RoutingContext())
        == estimated_seconds(req, unlucky, fleet, RoutingContext())
        == pytest.approx(10 * 0.02)
    )


def test_a_speculating_worker_is_costed_at_the_tokens_its_sequences_get_a_step():
    """Two workers with the same step; one keeps drafts (its engine measured 2.5 tokens a sequence
    gets a step): a request's decode costs it 2.5 times fewer steps, and the cost policy sends the
    request there."""
    req, fleet = request(prompt_tokens=0, decode=100), []
    plain = worker("plain", single_step_s=0.02, capability=1000.0)
    speculating = worker("spec", single_step_s=0.02, capability=1000.0, decode_tokens_per_step=2.5)
    fleet = [plain, speculating]
    assert estimated_seconds(req, plain, fleet, RoutingContext()) == pytest.approx(100 * 0.02)
    assert estimated_seconds(req, speculating, fleet, RoutingContext()) == pytest.approx(100 * 0.02 / 2.5)
    assert CostPolicy().choose(req, fleet, RoutingContext()).worker_id == "spec"


def test_the_engine_measures_the_tokens_a_sequence_gets_a_step_from_its_decode_steps():
    """Decode steps of 4 sequences given 4 tokens (no drafts kept) and 10 (drafts kept): the rate
    and tokens per step count what the sequences were given; a prefill step leaves both alone."""
    speed = SpeedEstimator(decay=0.0)
    speed.observe(0, 4, 0.1)
    assert speed.decode_tokens_per_step == pytest.approx(1.0)
    speed.observe(0, 4, 0.1, produced=10)
    assert speed.decode_tokens_per_step == pytest.approx(14 / 8)
    assert speed.decode_tokens_per_s == pytest.approx(14 / 0.2)
    speed.observe(100, 4, 0.5, produced=4)
    assert speed.decode_tokens_per_step == pytest.approx(14 / 8)


class TimedReplica:
    """A worker as the router sees it: steps of a fixed true duration (a tiny model's cost is its step
    delay), the engine's own SpeedEstimator fed with every step and seeded the way calibration seeds
    it, and the start-up calibration reported beside the live figures."""

    def __init__(
        self, name: str, step_s: float, single: float, batched: float, batch: int = 8, prefill: float = 2000.0
    ):
        self.name, self.step_s, self.single, self.batched = name, step_s, single, batched
        self.speed = SpeedEstimator()
        self.speed.seed(prefill, batched, batch / batched)
        self.remaining: list[int] = []  # tokens left per running request
        self.joining = 0  # requests whose prompt the next step computes
        self.next_step_s = 0.0
        self.generated_tokens = 0

    def view(self) -> WorkerView:
        speed = self.speed
        return worker(
            self.name,
            running=len(self.remaining),
            in_flight=len(self.remaining),
            outstanding_decode_tokens=sum(self.remaining),
            prefill_tokens_per_s=speed.prefill_tokens_per_s,
            decode_tokens_per_s=speed.decode_tokens_per_s,
            decode_step_s=speed.decode_step_s,
            single_step_s=1 / self.single,
            capability=self.batched,
            unmeasured=self.generated_tokens == 0,
        )

    def start(self, tokens: int, now_s: float) -> None:
        if not self.remaining:
            self.next_step_s = now_s + self.step_s
        self.remaining.append(tokens)
        self.joining += 1

    def step(self, prompt_tokens: int) -> int:
        """One step: every running request gets a token; returns how many requests finished."""
        self.speed.observe(self.joining * prompt_tokens, len(self.remaining) - self.joining, self.step_s)
        self.generated_tokens += len(self.remaining)
        self.joining = 0
        self.remaining = [left - 1 for left in self.remaining]
        finished = self.remaining.count(0)
        self.remaining = [left for left in self.remaining if left]
        self.next_step_s += self.step_s
        return finished


def closed_loop(replicas: list[TimedReplica], requests: int, clients: int, tokens: int, prompt_tokens: int = 3):
    """`clients` clients each send their next request as soon as the last one ends, until `requests`
    were sent; each is placed by the cost policy on the views of that moment. Returns the counts."""
    policy, picks, now_s = CostPolicy(), Counter(), 0.0

    def send() -> None:
        chosen = policy.choose(request(prompt_tokens, tokens), [r.view() for r in replicas], RoutingContext())
        next(r for r in replicas if r.name == chosen.worker_id).start(tokens, now_s)
        picks[chosen.worker_id] += 1

    for _ in range(clients):
        send()
    while any(r.remaining for r in replicas):
        stepping = min((r for r in replicas if r.remaining), key=lambda r: r.next_step_s)
        now_s = stepping.next_step_s
        for _ in range(stepping.step(prompt_tokens)):
            if picks.total() < requests:
                send()
    return picks


def test_a_fast_worker_calibrated_on_a_starved_cpu_still_gets_the_work_once_it_has_served():
    """The cost test that sent 48 of 48 requests to the slow worker: the fast worker (13 ms steps)
    reported a start-up calibration measured while other processes had the CPU (83 ms single-stream
    steps, 90 tokens/s at batch 8), below the slow worker's (45 ms steps, calibrated 50 ms). Idle, it
    was costed by that calibration although it had since served a stream at its real 13 ms, so it
    lost every request to the busy slow worker and, getting none, was never measured again."""
    fast = TimedReplica("fast", step_s=0.013, single=12.0, batched=90.0)
    slow = TimedReplica("slow", step_s=0.045, single=20.0, batched=160.0)
    fast.start(100, 0.0)  # the stream an earlier test ran on it
    while fast.remaining:
        fast.step(prompt_tokens=3)
    picks = closed_loop([fast, slow], requests=48, clients=8, tokens=24)
    assert picks["fast"] >= 2 * picks["slow"], picks


def test_cache_aware_follows_the_prefix_until_load_wins():
    text = "a long shared prefix " * 20
    req = request(text=text)
    full = {"a": len(req.prefix_blocks), "b": 0}
    policy = CacheAware(balance_abs_threshold=8, balance_rel_threshold=1.5)
    balanced = [worker("a", running=5), worker("b", running=3)]
    assert policy.choose(req, balanced, RoutingContext(matched_blocks=full)).worker_id == "a"
    hot = [worker("a", running=30), worker("b", running=2)]
    assert policy.choose(req, hot, RoutingContext(matched_blocks=full)).worker_id == "b"
    # A miss goes to the least loaded worker.
    assert (
        policy.choose(
            request(text="something else entirely, nothing cached " * 3), balanced, RoutingContext(matched_blocks={})
        ).worker_id
        == "b"
    )


def test_session_affinity_is_sticky_bounded_and_moves_few_keys():
    policy = SessionAffinity()
    four = [worker(n) for n in "abcd"]
    keys = [f"user-{i}" for i in range(2000)]
    before = {k: policy.choose(request(session_key=k), four, RoutingContext()).worker_id for k in keys}
    again = {k: policy.choose(request(session_key=k), four, RoutingContext()).worker_id for k in keys}
    assert before == again
    five = four + [worker("e")]
    after = {k: policy.choose(request(session_key=k), five, RoutingContext()).worker_id for k in keys}
    moved = sum(before[k] != after[k] for k in keys) / len(keys)
    assert moved < 0.3 and all(after[k] == "e" for k in keys if before[k] != after[k])
    # Bounded load: a key whose home worker is far over the average spills to another worker.
    key = keys[0]
    home = before[key]
    loaded = [worker(n, running=40 if n == home else 1) for n in "abcd"]
    assert policy.choose(request(session_key=key), loaded, RoutingContext()).worker_id != home


def test_session_affinity_without_a_key_uses_the_cost_policy():
    workers = [worker("a", running=30), worker("b")]
    assert SessionAffinity().choose(request(), workers, RoutingContext()).worker_id == "b"


def test_prefix_index_matches_leading_blocks_and_respects_capacity():
    index = PrefixIndex()
    first = canonical_chat(
        [
            {"role": "system", "content": "You are helpful. " * 8},
            {"role": "user", "content": "hello there, how are you today?"},
        ]
    ).text
    second = (
        first
        + canonical_chat(
            [{"role": "assistant", "content": "fine thanks " * 5}, {"role": "user", "content": "and now?"}]
        ).text
    )
    index.record("w", prefix_blocks(first), capacity_blocks=1000)
    matched = index.matched_blocks(prefix_blocks(second), ["w", "v"])
    assert matched["w"] == len(prefix_blocks(first)) and matched["v"] == 0
    index.record("w", prefix_blocks(second), capacity_blocks=3)
    assert index.size("w") == 3


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_every_policy_returns_an_eligible_worker(name):
    workers = [worker(n, running=i, outstanding_decode_tokens=10 * i) for i, n in enumerate("abc")]
    chosen = make_policy(name).choose(request(session_key="s"), workers, RoutingContext(rng=random.Random(0)))
    assert chosen in workers


def test_unknown_policy_names_the_choices():
    with pytest.raises(ValueError, match="round_robin"):
        make_policy("fastest")


def test_a_fast_worker_calibrated_on_a_starved_cpu_that_has_served_nothing_yet_is_tried_and_then_trusted():
    """The same two workers, but the fast one has generated nothing since it started: its speeds are
    its bad calibration's alone. Costed by them it would never get a request and never be measured;
    taken while idle to be as fast as the fastest idle worker, it gets one when the slow one is busy."""
    fast = TimedReplica("fast", step_s=0.013, single=12.0, batched=90.0)
    slow = TimedReplica("slow", step_s=0.045, single=20.0, batched=160.0)
    picks = closed_loop([fast, slow], requests=48, clients=8, tokens=24)
    assert picks["fast"] >= 2 * picks["slow"], picks


def test_a_worker_that_has_served_nothing_is_costed_as_the_fastest_idle_worker_only_while_idle():
    req = request(prompt_tokens=0, decode=10)
    proven = worker("proven", single_step_s=0.02, capability=1000.0)
    new = worker("new", single_step_s=0.2, capability=1000.0, unmeasured=True)
    fleet = [proven, new]
    assert estimated_seconds(req, new, fleet, RoutingContext()) == pytest.approx(10 * 0.02)
    busy_new = worker("new", running=1, decode_step_s=0.2, single_step_s=0.2, capability=1000.0, unmeasured=True)
    assert estimated_seconds(req, busy_new, [proven, busy_new], RoutingContext()) == pytest.approx(10 * 0.2)


def test_a_conversation_is_not_moved_off_its_cache_to_try_a_worker_that_has_served_nothing():
    """Its home looks busy (a load report from its last turn): the new worker is costed by its own
    (slow) calibration, not as the fleet's fastest, so the home keeps the conversation."""
    req = request(prompt_tokens=200, decode=4, text="a long shared system prompt " * 20)
    fast_prefill = {"prefill_tokens_per_s": 100_000.0, "capability": 1000.0}
    home = worker("home", running=1, decode_step_s=0.02, single_step_s=0.01, **fast_prefill)
    new = worker("new", single_step_s=0.05, unmeasured=True, **fast_prefill)
    context = RoutingContext(matched_blocks={"home": len(req.prefix_blocks)})
    assert CostPolicy().choose(req, [home, new], context).worker_id == "home"
    assert CostPolicy().choose(req, [home, new], RoutingContext()).worker_id == "new"


def test_the_prefix_index_takes_blocks_sent_longer_ago_than_the_paged_cache_holds_as_in_the_tier():
    index = PrefixIndex()
    old = prefix_blocks("an old conversation that went on for a while " * 8)
    index.record("w", old, capacity_blocks=1000)
    index.record("w", prefix_blocks("newer work, other prompts, lots of them " * 20), capacity_blocks=1000)
    newer = index.size("w") - len(old)
    assert index.in_tier("w", old, paged_blocks=newer + len(old)) == 0  # all still fit in the paged cache
    assert index.in_tier("w", old, paged_blocks=newer) == len(old)  # pushed down by what came after
    assert 0 < index.in_tier("w", old, paged_blocks=newer + len(old) // 2) < len(old)


def test_cost_and_cache_aware_policies_count_a_tier_hit_at_the_cost_of_copying_it_back():
    req = request(prompt_tokens=2000, decode=10, text="shared system prompt " * 40)
    blocks = len(req.prefix_blocks)
    paged = worker("a", prefill_tokens_per_s=1000)
    context = RoutingContext(matched_blocks={"a": blocks, "b": blocks}, tier_blocks={"b": blocks})
    slow_tier = worker("b", prefill_tokens_per_s=1000, kv_tier_tokens=10_000, kv_tier_load_tokens_per_s=2000)
    fleet = [paged, slow_tier]
    # the tier hit costs its copy (1 s at 2000 tokens/s): more than a paged hit, far less than a miss
    hit, tier_hit = (estimated_seconds(req, w, fleet, context) for w in fleet)
    miss = estimated_seconds(req, paged, fleet, RoutingContext())
    assert hit < tier_hit < miss
    assert CostPolicy().choose(req, fleet, context).worker_id == "a"
    # cache-aware: a tier that loads no faster than prefill saves nothing; a fast one nearly all
    useless = worker("b", prefill_tokens_per_s=1000, kv_tier_tokens=10_000, kv_tier_load_tokens_per_s=1000, running=1)
    cold = worker("c", prefill_tokens_per_s=1000)
    policy = CacheAware()
    assert policy.choose(req, [useless, cold], context).worker_id == "c"
    fast = worker("b", prefill_tokens_per_s=1000, kv_tier_tokens=10_000, kv_tier_load_tokens_per_s=1e6, running=1)
    assert policy.choose(req, [fast, cold], context).worker_id == "b"
