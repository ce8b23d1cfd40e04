"""How the router tells a busy worker from a hung one: the keep-alive comment a worker sends on a
silent stream, the deadlines derived from it, which workers a request may go back to, and the
engine's estimate of how long a step should take."""

from __future__ import annotations

import math

import pytest

from shoal.engine.speed import SpeedEstimator
from shoal.protocol.keep_alive import BARE, KeepAlive, parse_keep_alive
from shoal.router.config import FailoverSettings
from shoal.router.fleet.circuit_breaker import CircuitBreaker
from shoal.router.fleet.worker_state import WorkerState
from shoal.router.streams.relay import token_deadline
from shoal.router.streams.tried_workers import TriedWorkers
from shoal.router.views import RouteRequest


def test_a_keep_alive_round_trips_and_a_bare_one_has_no_figures():
    sent = KeepAlive(busy_s=1.25, step_s=3.5)
    line, blank = sent.encode().split(b"\n", 1)
    assert line.startswith(b": ") and blank == b"\n"  # an SSE comment, then the end of the event
    assert parse_keep_alive(line + b"\n") == sent
    assert parse_keep_alive(BARE.split(b"\n")[0]) == KeepAlive()
    assert parse_keep_alive(KeepAlive(busy_s=0.5).encode().split(b"\n")[0]) == KeepAlive(busy_s=0.5)


@pytest.mark.parametrize("line", [b"data: {}", b": ping", b": keep-alives", b"", b"event: keep-alive"])
def test_other_lines_are_not_keep_alives(line):
    assert parse_keep_alive(line) is None


@pytest.mark.parametrize(
    "body", [b"{not json", b'{"busy_s": -1}', b'{"step_s": "slow"}', b'{"busy_s": 1e999}', b'{"extra": 1}', b"[1, 2]"]
)
def test_malformed_figures_leave_a_bare_keep_alive(body):
    assert parse_keep_alive(b": keep-alive " + body) == KeepAlive()


def test_the_deadline_follows_the_expected_time_within_its_bounds():
    settings = FailoverSettings(token_deadline_factor=10, token_deadline_min_s=2, token_deadline_max_s=30)
    assert token_deadline(settings, None) == 30
    assert token_deadline(settings, 0.01) == 2
    assert token_deadline(settings, 0.5) == 5
    assert token_deadline(settings, 60) == 30


def worker(worker_id: str) -> WorkerState:
    return WorkerState(worker_id, worker_id, frozenset({"m"}), CircuitBreaker(5, 5.0, 60.0, lambda *_: None))


def test_a_worker_left_for_looking_hung_returns_once_heard_from_and_a_failed_one_never():
    workers = {w: worker(w) for w in ("busy", "crashed", "fine")}
    tried = TriedWorkers()
    tried.leave("busy", now=workers["busy"].last_seen + 1)
    tried.fail("crashed")
    assert tried.excluded(workers) == {"busy", "crashed"}
    workers["busy"].last_seen += 2  # a poll or heartbeat after it was left
    workers["crashed"].last_seen += 2
    assert tried.excluded(workers) == {"crashed"}
    tried.leave("crashed", now=workers["crashed"].last_seen - 1)  # a failure is for good
    assert tried.excluded(workers) == {"crashed"}


def test_waiting_is_no_use_only_once_every_worker_of_the_model_failed_the_request():
    workers = {w: worker(w) for w in ("a", "b")}
    workers["other"] = WorkerState("other", "other", frozenset({"n"}), workers["a"].breaker)
    m, n = (RouteRequest(model, 10, 10) for model in ("m", "n"))
    tried = TriedWorkers()
    assert not tried.failed_by_all(workers, m)
    tried.fail("a")
    tried.leave("b", now=0.0)  # refused for now (503) or lost: it may come back
    assert not tried.failed_by_all(workers, m)
    tried.fail("b")
    assert tried.failed_by_all(workers, m) and not tried.failed_by_all(workers, n)
    assert not TriedWorkers().failed_by_all({}, m)  # no worker yet: one may come


def test_a_step_is_expected_to_take_its_prefill_at_the_prefill_rate_plus_a_decode_step():
    speed = SpeedEstimator()
    assert speed.step_seconds(512, 4) is None  # nothing measured yet
    speed.seed(prefill_tokens_per_s=1000.0, decode_tokens_per_s=80.0, decode_step_s=0.1)
    assert math.isclose(speed.step_seconds(512, 0), 0.512)
    assert math.isclose(speed.step_seconds(0, 8), 0.1)
    assert math.isclose(speed.step_seconds(512, 8), 0.612)
    assert speed.step_seconds(0, 0) is None
