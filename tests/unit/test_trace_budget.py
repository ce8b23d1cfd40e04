"""Which new traces are recorded: the first `per_second` of each second, then `ratio` of the rest."""

from __future__ import annotations

import random

from shoal.observability import trace_sampling
from shoal.observability.trace_sampling import TraceBudget


def test_each_second_admits_its_reservoir_then_the_ratio_of_the_rest(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(trace_sampling.time, "monotonic", lambda: now[0])
    budget = TraceBudget(per_second=3, ratio=0.0)
    assert [budget.admit() for _ in range(5)] == [True, True, True, False, False]
    now[0] += 0.5
    assert not budget.admit()  # the same second
    now[0] += 0.6
    assert [budget.admit() for _ in range(4)] == [True, True, True, False]


def test_past_the_reservoir_about_ratio_of_requests_are_traced(monkeypatch):
    monkeypatch.setattr(trace_sampling.time, "monotonic", lambda: 5.0)
    random.seed(7)
    budget = TraceBudget(per_second=10, ratio=0.1)
    admitted = sum(budget.admit() for _ in range(10_010))
    assert 10 + 850 < admitted < 10 + 1150


def test_an_unlimited_reservoir_traces_everything():
    budget = TraceBudget(per_second=float("inf"), ratio=0.0)
    assert all(budget.admit() for _ in range(1000))
