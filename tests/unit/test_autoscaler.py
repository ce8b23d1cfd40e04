"""The autoscaler's decision rule, with explicit clocks: delays, hysteresis, bounds, scale to zero."""

from __future__ import annotations

from shoal.cluster.autoscaler import Signals, Trend, decide, ratios
from shoal.cluster.config import Autoscaling

TARGETS = Autoscaling(
    min_replicas=1,
    max_replicas=3,
    target_queued_per_replica=2,
    target_outstanding_tokens_per_replica=1000,
    target_kv_cache_usage=0.8,
    target_ttft_s=1.0,
    upscale_delay_s=5,
    downscale_delay_s=30,
)


def signals(replicas=1, queued=0, in_flight=0, outstanding=0, kv=0.0, ttft=None) -> Signals:
    return Signals(replicas, queued, in_flight, outstanding, kv, ttft, None)


def test_pressure_must_last_the_upscale_delay_and_stops_at_max():
    trend = Trend()
    busy = signals(replicas=1, queued=5, in_flight=4)
    assert decide(busy, TARGETS, trend, now=0) == 1
    assert decide(busy, TARGETS, trend, now=4.9) == 1
    assert decide(busy, TARGETS, trend, now=5.0) == 2
    assert decide(signals(replicas=2, queued=9, in_flight=8), TARGETS, trend, now=5.1) == 2  # the delay restarts
    assert decide(signals(replicas=3, queued=9, in_flight=8), TARGETS, trend, now=100) == 3
    assert decide(signals(replicas=3, queued=9, in_flight=8), TARGETS, trend, now=200) == 3  # max_replicas


def test_any_signal_over_target_is_pressure_and_latency_counts_only_while_requests_run():
    assert max(ratios(signals(outstanding=2500), TARGETS)) == 2.5
    assert max(ratios(signals(kv=0.96), TARGETS)) == 1.2
    assert max(ratios(signals(in_flight=1, ttft=3.0), TARGETS)) == 3.0
    assert max(ratios(signals(in_flight=0, ttft=3.0), TARGETS)) == 0.0


def test_quiet_must_last_the_downscale_delay_and_the_band_between_is_left_alone():
    trend = Trend()
    middling = signals(replicas=2, queued=2, in_flight=2)  # 1 queued per replica: half the target, not under
    assert decide(middling, TARGETS, trend, now=0) == 2
    assert decide(middling, TARGETS, trend, now=1000) == 2
    quiet = signals(replicas=2, in_flight=1, outstanding=100)
    assert decide(quiet, TARGETS, trend, now=1000) == 2
    assert decide(quiet, TARGETS, trend, now=1029) == 2
    assert decide(quiet, TARGETS, trend, now=1030) == 1
    assert decide(signals(replicas=1), TARGETS, trend, now=5000) == 1  # min_replicas


def test_scale_to_zero_when_idle_and_back_at_once_for_a_waiting_request():
    targets = TARGETS.model_copy(update={"min_replicas": 0})
    trend = Trend()
    assert decide(signals(replicas=1, in_flight=1), targets, trend, now=0) == 1
    assert decide(signals(replicas=1, in_flight=1), targets, trend, now=100) == 1  # quiet but busy: keep one
    assert decide(signals(replicas=1), targets, trend, now=100) == 1
    assert decide(signals(replicas=1), targets, trend, now=130) == 0
    assert decide(signals(replicas=0), targets, trend, now=131) == 0
    assert decide(signals(replicas=0, queued=1), targets, trend, now=132) == 1


def test_nothing_is_scaled_down_while_a_replica_is_still_starting():
    targets = TARGETS.model_copy(update={"min_replicas": 0})
    trend = Trend()
    starting = Signals(1, 0, 0, 0, None, None, None, starting=1)
    assert decide(starting, targets, trend, now=0) == 1
    assert decide(starting, targets, trend, now=1000) == 1
    assert decide(signals(replicas=1), targets, trend, now=1001) == 1  # the idle time counts from here
    assert decide(signals(replicas=1), targets, trend, now=1031) == 0
