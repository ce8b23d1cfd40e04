"""What the router learns of a server that reports no load, from the requests it relays there."""

from __future__ import annotations

import time

import pytest

from shoal.router.fleet.circuit_breaker import CircuitBreaker
from shoal.router.fleet.served_concurrency import ServedConcurrency
from shoal.router.fleet.worker_state import WorkerState


def worker_state(**fields) -> WorkerState:
    return WorkerState("w", "w", frozenset({"m"}), CircuitBreaker(5, 5.0, 60.0, lambda *_: None), **fields)


def test_a_serial_server_shows_one_at_a_time_and_each_request_is_served_from_the_previous_ones_end():
    """Two requests sent together at t=0; the second is answered only when the first ends at 3 s and
    ends at 7 s: it was served for 4 s, not 7."""
    seen = ServedConcurrency()
    seen.started(sent_at=0.0, computed_tokens=200, now=2.0)
    seen.ended(sent_at=0.0, now=3.0)
    seen.started(sent_at=0.0, computed_tokens=0, now=3.5)  # all of its prompt cached: no prefill measured
    seen.ended(sent_at=0.0, now=7.0)
    assert seen.most == 1 and seen.serving == 0
    assert seen.service_s == pytest.approx(3.0 + 0.1 * (4.0 - 3.0))
    assert seen.prefill_tokens_per_s == pytest.approx(100.0)


def test_prefill_is_timed_from_when_a_serial_server_took_the_request():
    """Sent at 0 behind one that ended at 5; its first token at 6 after 300 tokens: 300 tokens/s."""
    seen = ServedConcurrency(last_end=5.0)
    seen.started(sent_at=0.0, computed_tokens=300, now=6.0)
    assert seen.prefill_tokens_per_s == pytest.approx(300.0)
    seen.ended(sent_at=0.0, now=8.0)
    seen.started(sent_at=9.0, computed_tokens=100, now=10.0)
    assert seen.prefill_tokens_per_s == pytest.approx(300.0 + 0.1 * (100.0 - 300.0))


def test_a_batching_server_shows_the_requests_it_serves_together():
    seen = ServedConcurrency()
    for _ in range(3):
        seen.started(sent_at=0.0, computed_tokens=10, now=1.0)
    seen.ended(sent_at=0.0, now=2.0)
    seen.started(sent_at=0.0, computed_tokens=10, now=2.5)
    assert seen.most == 3 and seen.serving == 3


def test_the_view_carries_what_was_learned_only_for_a_server_that_reports_no_load():
    state = worker_state()
    first, second = state.start(10, 20), state.start(10, 20)
    state.first_byte(first)
    state.first_byte(second)  # headers are no proof of being served (llama-cpp-python queues after them)
    assert state.concurrency.most == 1 and state.concurrency.serving == 0
    state.first_token(first)
    state.first_token(first)  # counted once
    state.first_token(second)
    state.finish(first)
    state.finish(second)
    unanswered = state.start(10, 20)
    state.finish(unanswered)  # never served: no service time
    assert state.concurrency.most == 2 and state.concurrency.serving == 0
    assert state.view().served_concurrency is None  # its load source is not known yet
    state.load_source = "router"
    view = state.view()
    assert view.served_concurrency == 2 and view.service_s == state.concurrency.service_s is not None
    state.load_source = "prometheus"
    assert state.view().served_concurrency is None and state.view().service_s is None


def test_a_server_that_reports_nothing_is_priced_at_the_speeds_measured_there(monkeypatch):
    """Its first token 2 s after it took a request expected to compute 300 tokens, then 25 ms between
    tokens: 150 prefill tokens/s, a 25 ms step, 40 tokens/s serving one at a time."""
    clock = [0.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    state = worker_state(load_source="router")
    assert (state.view().prefill_tokens_per_s, state.view().decode_step_s) == (None, None)
    ticket = state.start(300, 32)
    state.first_byte(ticket)
    clock[0] = 2.0
    state.first_token(ticket)
    state.latency.observe_itl(0.025)
    view = state.view()
    assert view.prefill_tokens_per_s == pytest.approx(150.0)
    assert view.decode_step_s == pytest.approx(0.025) and view.decode_tokens_per_s == pytest.approx(40.0)
    state.load_source = "shoal"  # a worker that reports shows its report's figures, not these
    assert (state.view().prefill_tokens_per_s, state.view().decode_step_s) == (None, None)


def test_the_view_says_how_long_the_oldest_request_there_has_been_served(monkeypatch):
    """Since it was sent, or since the previous request ended if later (a serial server took it then)."""
    clock = [100.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    state = worker_state(load_source="router")
    assert state.view().busy_s == 0.0
    first, second = state.start(10, 20), state.start(10, 20)
    clock[0] = 107.0
    assert state.view().busy_s == pytest.approx(7.0) and state.view().service_s is None
    state.first_token(first)
    state.finish(first)
    clock[0] = 108.0
    assert state.view().busy_s == pytest.approx(1.0) and state.view().service_s == pytest.approx(7.0)
    state.first_token(second)
    state.finish(second)
    assert state.view().busy_s == 0.0
