"""What the router measures of a worker's streams stands in for the speeds a server does not report."""

from __future__ import annotations

from shoal.router.circuit_breaker import CircuitBreaker
from shoal.router.latency_stats import LatencyStats
from shoal.router.load_report import LoadReport
from shoal.router.membership import WorkerState


def test_the_output_rate_counts_steady_output_over_all_streams():
    stats = LatencyStats()
    for i in range(31):  # two streams, 20 tokens a second each, for 1.5 s
        stats.observe_output(2, 10.0 + i * 0.05)
    assert stats.rate_samples == 1 and abs(stats.output_tokens_per_s - 40.0) < 0.1


def test_idle_time_between_bursts_does_not_lower_the_rate():
    stats = LatencyStats()
    for burst in (0.0, 60.0):  # a minute idle between two bursts of 30 tokens a second
        for i in range(35):
            stats.observe_output(1, burst + i / 30)
    assert stats.rate_samples == 2 and 29 < stats.output_tokens_per_s < 32


def worker_at(url: str) -> WorkerState:
    return WorkerState(url, url, frozenset({"m"}), CircuitBreaker(5, 1.0, 30.0, lambda old, new, reason: None))


def test_a_server_without_speeds_is_seen_through_its_measured_streams():
    worker = worker_at("http://peer:1")
    worker.report = LoadReport(running=1, engine="vllm")
    assert (worker.view().decode_step_s, worker.view().decode_tokens_per_s) == (None, None)
    worker.latency.observe_itl(0.02)
    for i in range(25):
        worker.latency.observe_output(1, i * 0.05)
    view = worker.view()
    assert view.decode_step_s == 0.02 and abs(view.decode_tokens_per_s - 20.0) < 0.1


def test_a_shoal_worker_s_own_figures_are_kept():
    worker = worker_at("http://shoal:1")
    worker.report = LoadReport(decode_step_s=0.01, decode_tokens_per_s=300.0, capability=300.0)
    worker.latency.observe_itl(0.5)
    for i in range(25):
        worker.latency.observe_output(1, i * 0.05)
    assert (worker.view().decode_step_s, worker.view().decode_tokens_per_s) == (0.01, 300.0)
