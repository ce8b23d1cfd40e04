"""The router's Prometheus metrics: requests by model, status and priority; retries and
migrations; latency histograms as clients see them (time to first token, between tokens, end to
end); and, read at scrape time, each worker's load and health as the router sees it and the
admission queues by priority. Worker health changes (ejections, breaker transitions) are counted by
HealthEvents in the same registry. `window` holds the same request figures over the last seconds,
for the dashboard's live charts.

In a router group every member's counters and histograms live in files in the group's directory
(prometheus_client's multiprocess mode), and a scrape of any member sums them (`group_registry`):
requests, retries, migrations, latency histograms and health transitions (as each member saw them)
of the whole group. The gauges are the scraped member's: the workers' load, in-flight requests
included, is shared by the group; the admission queue is its own."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from shoal.observability.latency_buckets import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS
from shoal.observability.request_window import RequestWindow
from shoal.router.fleet.membership import Membership

BREAKER_STATES = ("closed", "open", "half_open")
MULTIPROCESS_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"


def group_registry(directory: Path) -> CollectorRegistry:
    """A registry of the sums of every group member's counters and histograms (their files in
    `directory`, which MULTIPROCESS_DIR_VARIABLE named when this process started)."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))
    return registry


class RouterMetrics:
    """Counters and histograms the request path feeds; gauges collected from membership and the
    admission queues at scrape time (so a scrape never waits on the request path)."""

    def __init__(self, registry: CollectorRegistry):
        self.requests = Counter(
            "shoal_router_requests",
            "Requests answered, by model, HTTP status and priority.",
            ["model", "status", "priority"],
            registry=registry,
        )
        self.targets = Counter(
            "shoal_router_target_requests",
            "Requests with latency targets as they ended, by model and outcome (met, missed): goodput "
            "is the rate of met.",
            ["model", "outcome"],
            registry=registry,
        )
        self.retries = Counter(
            "shoal_router_retries",
            "Requests sent again to another worker before their first byte.",
            ["model"],
            registry=registry,
        )
        self.migrations = Counter(
            "shoal_router_migrations", "Streams moved to another worker mid-generation.", ["model"], registry=registry
        )
        self.handoffs = Counter(
            "shoal_router_handoffs",
            "Streams a worker handed off to another, with their KV (reason: prefill, drain).",
            ["model", "reason"],
            registry=registry,
        )
        self.ttft = Histogram(
            "shoal_router_time_to_first_token_seconds",
            "Arrival at the router to the first token relayed.",
            ["model"],
            buckets=TTFT_BUCKETS,
            registry=registry,
        )
        self.itl = Histogram(
            "shoal_router_inter_token_latency_seconds",
            "Time between tokens relayed.",
            ["model"],
            buckets=ITL_BUCKETS,
            registry=registry,
        )
        self.e2e = Histogram(
            "shoal_router_e2e_request_latency_seconds",
            "Arrival at the router to the end of the response.",
            ["model"],
            buckets=E2E_BUCKETS,
            registry=registry,
        )
        self.window = RequestWindow()
        self._children: dict[tuple, object] = {}

    def child(self, metric: Counter | Histogram, *labels: str):
        """`metric`'s child for `labels`, found once: labels() takes a lock and builds its key on
        every call, and the request path asks for a few children per token. Bounded by the label
        values the caller passes (models the cluster serves, statuses, priorities, reasons)."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def watch(self, registry: CollectorRegistry, membership: Membership, queued: Callable[[], dict[str, int]]) -> None:
        """Adds the gauges read at scrape time."""
        registry.register(FleetCollector(membership, queued))


class FleetCollector(Collector):
    """Each worker's load, health and breaker state; requests queued by priority."""

    def __init__(self, membership: Membership, queued: Callable[[], dict[str, int]]):
        self.membership = membership
        self.queued = queued

    def collect(self):
        series = {
            name: GaugeMetricFamily(f"shoal_router_worker_{name}", text, labels=["worker"])
            for name, text in (
                ("in_flight", "Requests the router has on the worker."),
                ("running", "Requests running on the worker (its latest report)."),
                ("waiting", "Requests queued on the worker (its latest report)."),
                ("outstanding_tokens", "Prefill and decode tokens still to do on the worker."),
                ("free_kv_tokens", "Free KV-cache tokens on the worker."),
                ("healthy", "1 while the worker takes requests."),
                ("ejected", "1 while the worker is ejected as an outlier."),
            )
        }
        breaker = GaugeMetricFamily(
            "shoal_router_worker_breaker_state", "1 for the worker's circuit-breaker state.", labels=["worker", "state"]
        )
        for state in list(self.membership.workers.values()):
            view, worker = state.view(), [state.worker_id]
            values = {
                "in_flight": view.in_flight,
                "running": view.running,
                "waiting": view.waiting,
                "outstanding_tokens": view.outstanding_tokens,
                "free_kv_tokens": view.free_kv_tokens,
                "healthy": int(state.available),
                "ejected": int(state.ejected_until is not None),
            }
            for name, value in values.items():
                if value is not None:
                    series[name].add_metric(worker, value)
            for name in BREAKER_STATES:
                breaker.add_metric([state.worker_id, name], int(str(state.breaker.state) == name))
        queued = GaugeMetricFamily(
            "shoal_router_queued_requests", "Requests waiting for admission.", labels=["priority"]
        )
        for priority, count in self.queued().items():
            queued.add_metric([priority], count)
        yield from series.values()
        yield breaker
        yield queued
