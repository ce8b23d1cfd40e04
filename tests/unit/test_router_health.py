"""The router's health decisions, driven with explicit clocks: circuit breaker states, outlier
ejection and the monitor's down/up/ejected transitions, each logged and counted."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from shoal.router.config import HealthSettings
from shoal.router.fleet.circuit_breaker import BreakerState, CircuitBreaker
from shoal.router.fleet.health_events import HealthEvents
from shoal.router.fleet.health_monitor import HealthMonitor
from shoal.router.fleet.load_report import LoadReport
from shoal.router.fleet.membership import Membership
from shoal.router.fleet.outlier_detection import normalised, outliers


def make_breaker():
    changes = []
    breaker = CircuitBreaker(3, open_s=5.0, max_open_s=12.0, on_change=lambda old, new, why: changes.append(new))
    return breaker, changes


def test_breaker_opens_after_consecutive_failures_only():
    breaker, changes = make_breaker()
    breaker.record_failure("500", now=0)
    breaker.record_failure("500", now=0)
    breaker.record_success()  # a 4xx or a good answer resets the count
    breaker.record_failure("500", now=0)
    breaker.record_failure("500", now=0)
    assert breaker.state is BreakerState.CLOSED and breaker.allows()
    breaker.record_failure("500", now=1)
    assert breaker.state is BreakerState.OPEN and not breaker.allows() and changes == [BreakerState.OPEN]


def test_breaker_half_opens_for_one_probe_and_backs_off_when_it_fails():
    breaker, changes = make_breaker()
    for _ in range(3):
        breaker.record_failure("500", now=0)
    breaker.tick(4.9)
    assert breaker.state is BreakerState.OPEN
    breaker.tick(5.0)
    assert breaker.state is BreakerState.HALF_OPEN and breaker.allows()
    breaker.take(5.0)
    assert not breaker.allows()  # one probe at a time
    breaker.record_failure("probe 500", now=6)
    assert breaker.state is BreakerState.OPEN and breaker.open_for == 10.0
    breaker.tick(15.9)
    assert breaker.state is BreakerState.OPEN
    breaker.tick(16.0)
    breaker.take(16.0)
    breaker.record_failure("probe 500", now=16)
    assert breaker.open_for == 12.0  # capped at max_open_s
    breaker.tick(28.0)
    breaker.record_success()
    assert breaker.state is BreakerState.CLOSED and breaker.open_for == 5.0
    assert changes == [
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.OPEN,
        BreakerState.HALF_OPEN,
        BreakerState.CLOSED,
    ]


def test_a_lost_probe_frees_the_probe_slot():
    breaker, _ = make_breaker()
    for _ in range(3):
        breaker.record_failure("500", now=0)
    breaker.tick(5.0)
    breaker.take(5.0)
    breaker.tick(9.0)
    assert not breaker.allows()
    breaker.tick(10.1)
    assert breaker.allows() and breaker.state is BreakerState.HALF_OPEN


def test_outliers_need_three_workers_and_a_factor_over_the_median():
    assert outliers({"a": 1.0, "b": 10.0}, factor=3, min_workers=3) == set()
    assert outliers({"a": 1.0, "b": 1.1, "c": 3.4}, factor=3, min_workers=3) == {"c"}
    assert outliers({"a": 1.0, "b": 1.1, "c": 3.2}, factor=3, min_workers=3) == set()
    assert outliers({"a": 1.0, "b": 1.1, "c": 9.0}, factor=3, min_workers=4) == set()


def test_latencies_are_compared_in_units_of_each_workers_own_step_time():
    # c is a four times slower kind of hardware, not a failing worker.
    latencies = {"a": 0.010, "b": 0.011, "c": 0.040}
    steps = {"a": 0.010, "b": 0.010, "c": 0.040}
    assert outliers(normalised(latencies, steps), factor=3, min_workers=3) == set()
    assert normalised(latencies, {"a": 0.01, "b": None, "c": 0.04}) == latencies


@pytest.fixture
def fleet():
    """A membership of three registered-looking workers with a monitor; returns (monitor, events)."""
    settings = HealthSettings(heartbeat_interval_s=1.0, missed_heartbeats=2, lease_s=3.0)
    events = HealthEvents(CollectorRegistry())
    membership = Membership(settings, events)
    for name in "abc":
        state = membership._new_state(f"http://{name}", frozenset({"m"}), registered=False)
        state.last_seen = 0.0
        state.report = LoadReport(single_step_s=0.01)
        membership.workers[state.worker_id] = state
    forgotten = []
    return HealthMonitor(membership, settings, events, forgotten.append), events


def changes(events: HealthEvents) -> list[tuple[str, str]]:
    return [(e["worker_id"], e["change"]) for e in events.recent]


def test_a_silent_worker_is_down_after_missed_heartbeats_and_up_when_it_answers(fleet):
    monitor, events = fleet
    workers = monitor.membership.workers
    for state in workers.values():
        state.last_seen = 1.0
    monitor.check(2.7)
    assert all(s.available for s in workers.values())
    workers["http://a"].last_seen = workers["http://b"].last_seen = 2.8
    monitor.check(2.8)  # c silent for 1.8 s: the next tick would be past 2 × 1 s
    assert not workers["http://c"].available and workers["http://c"].down
    assert events.transitions.labels("http://c", "down")._value.get() == 1
    workers["http://c"].latency.observe_itl(5.0)
    workers["http://c"].last_seen = 3.5
    assert monitor.check(3.6) is True  # capacity grew
    assert workers["http://c"].available and workers["http://c"].latency.itl_samples == 0
    assert changes(events) == [("http://c", "down"), ("http://c", "up")]


def test_a_silence_that_spans_the_routers_own_stall_is_not_the_workers(fleet):
    """The router's checks stop for 2.5 s (its CPU taken): the workers' answers may be unread in its
    sockets, so none is down when it wakes; one still silent for the limit the router was awake is."""
    monitor, events = fleet
    workers = monitor.membership.workers
    for state in workers.values():
        state.last_seen = 1.0
    monitor.check(1.0)
    monitor.check(3.5)
    assert all(s.available for s in workers.values()) and changes(events) == []
    workers["http://a"].last_seen = workers["http://b"].last_seen = 5.0
    for now in (3.75, 4.0, 4.25, 4.5, 4.75, 5.0, 5.25, 5.5):
        monitor.check(now)
    assert changes(events) == [("http://c", "down")]


def test_a_refused_poll_marks_a_worker_down_at_once(fleet):
    monitor, events = fleet
    state = monitor.membership.workers["http://a"]
    state.refused_at = 0.2
    monitor.check(0.3)
    assert state.down and changes(events) == [("http://a", "down")]


def test_a_connection_lost_on_a_request_marks_down_but_a_5xx_only_feeds_the_breaker(fleet):
    monitor, events = fleet
    a, b = monitor.membership.workers["http://a"], monitor.membership.workers["http://b"]
    monitor.request_failed(a, "answered 500", connection_lost=False)
    assert a.available and a.breaker.consecutive_failures == 1
    monitor.request_failed(b, "ServerDisconnectedError", connection_lost=True)
    assert b.down and not b.available


def test_the_slowest_worker_is_ejected_then_rejoins_with_fresh_figures(fleet):
    monitor, events = fleet
    workers = list(monitor.membership.workers.values())
    for state, itl in zip(workers, (0.010, 0.012, 0.050)):
        state.last_seen = 100.0
        for _ in range(25):
            state.latency.observe_itl(itl)
    monitor.check(100.0)
    slow = workers[2]
    assert slow.ejected_until == pytest.approx(130.0) and not slow.available
    assert changes(events) == [("http://c", "ejected")]
    reason = events.recent[-1]["reason"]
    assert reason.endswith("inter-token latency 50 ms, 4.2x the median of 3 workers"), reason
    for state in workers:
        state.last_seen = 130.0
    monitor.check(130.0)
    assert slow.available and slow.latency.itl_samples == 0
    assert changes(events)[-1] == ("http://c", "rejoined")


def test_a_worker_batching_more_streams_than_its_peers_is_busy_not_an_outlier(fleet):
    """Steps of 10 ms alone and 100 tokens/s at most in all: c runs four streams where a and b run
    one, so its tokens come 40 ms apart, 4x theirs, which is its batch, not a failure; the same gap
    with one stream there is."""
    monitor, events = fleet
    workers = list(monitor.membership.workers.values())
    for state, itl, running in zip(workers, (0.010, 0.011, 0.040), (1, 1, 4)):
        state.report = LoadReport(single_step_s=0.01, capability=100.0, running=running)
        state.last_seen = 100.0
        for _ in range(25):
            state.latency.observe_itl(itl)
    monitor.check(100.0)
    assert changes(events) == []
    workers[2].report = LoadReport(single_step_s=0.01, capability=100.0, running=1)
    monitor.next_outlier_check = 0.0
    monitor.check(100.0)
    assert changes(events) == [("http://c", "ejected")]


def test_tokens_that_now_and_then_wait_for_a_long_prompt_are_not_an_outlier(fleet):
    """c's streams mostly get a token every 11 ms, but every tenth gap is a 4 s step computing a
    history another conversation brought: its mean gap is 40 times its peers', its typical gap is theirs."""
    monitor, events = fleet
    workers = list(monitor.membership.workers.values())
    for state in workers:
        state.last_seen = 100.0
        for sample in range(30):
            state.latency.observe_itl(4.0 if state is workers[2] and sample % 10 == 9 else 0.011)
    assert workers[2].latency.itl_s > 40 * workers[0].latency.itl_s
    monitor.check(100.0)
    assert changes(events) == []


def add_measured_worker(membership: Membership, name: str, itl: float, report: LoadReport | None) -> None:
    """http://NAME, last seen at 100 s, with 25 inter-token latencies of `itl` measured."""
    state = membership._new_state(f"http://{name}", frozenset({"m"}), registered=False)
    state.last_seen, state.report = 100.0, report
    for _ in range(25):
        state.latency.observe_itl(itl)
    membership.workers[state.worker_id] = state


def test_at_most_the_configured_fraction_of_a_model_is_ejected_worst_first():
    settings = HealthSettings(outliers={"max_ejected_fraction": 0.25})
    events = HealthEvents(CollectorRegistry())
    membership = Membership(settings, events)
    for name, itl in zip("abcde", (0.010, 0.010, 0.011, 0.050, 0.090)):
        add_measured_worker(membership, name, itl, report=None)
    HealthMonitor(membership, settings, events, lambda worker_id: None).check(100.0)
    assert changes(events) == [("http://e", "ejected")]  # d is an outlier too, but 1 of 5 is the budget


def test_latencies_are_compared_only_among_workers_running_the_same_engine():
    """Two llama.cpp servers streaming one request each at 15 ms a token beside a shoal worker
    batching a dozen at 180 ms: nobody is an outlier. A third llama.cpp server at 90 ms is one."""
    settings = HealthSettings()
    events = HealthEvents(CollectorRegistry())
    membership = Membership(settings, events)
    for name, engine, itl in (("a", "shoal", 0.180), ("b", "llama.cpp", 0.015), ("c", "llama.cpp", 0.015)):
        add_measured_worker(membership, name, itl, LoadReport(engine=engine))
    monitor = HealthMonitor(membership, settings, events, lambda worker_id: None)
    monitor.check(100.0)
    assert changes(events) == []
    add_measured_worker(membership, "d", 0.090, LoadReport(engine="llama.cpp"))
    monitor.check(101.0)
    assert changes(events) == [("http://d", "ejected")]


def test_a_half_open_worker_counts_as_one_admission_slot_for_its_probe(fleet):
    from prometheus_client import CollectorRegistry

    from shoal.observability.tracing import Tracing
    from shoal.router.config import RouterConfig
    from shoal.router.front_door import FrontDoor
    from shoal.router.metrics import RouterMetrics
    from shoal.router.placement.balancer import Balancer
    from shoal.router.placement.policies import make_policy

    monitor, _ = fleet
    membership = monitor.membership
    front_door = FrontDoor(
        RouterConfig(admission={"max_in_flight_per_worker": 8}),
        membership,
        Balancer(make_policy("round_robin"), membership),
        monitor,
        Tracing("test"),
        RouterMetrics(CollectorRegistry()),
    )
    assert front_door.capacity("m") == 24
    breaker = membership.workers["http://a"].breaker
    for _ in range(breaker.failure_threshold):
        breaker.record_failure("500", now=0)
    assert front_door.capacity("m") == 16
    breaker.tick(breaker.open_s)
    assert front_door.capacity("m") == 17
