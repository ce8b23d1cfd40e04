"""Every change of a worker's health, logged, counted (Prometheus) and put in the cluster's event
feed (kind `health`), where operators (`GET /admin/workers`) and the dashboard read it."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter

from shoal.observability.cluster_events import ClusterEvents

log = logging.getLogger("shoal.router.health")

HEALTHY_CHANGES = ("up", "registered", "rejoined", "breaker_closed")


class HealthEvents:
    """Invariant: `recent` holds the latest health changes the feed keeps, oldest first; the counter
    counts all. Without a feed of its own, it keeps one just for them."""

    def __init__(self, registry: CollectorRegistry, feed: ClusterEvents | None = None):
        self.transitions = Counter(
            "shoal_router_worker_transitions",
            "Health state changes of workers",
            ["worker", "change"],
            registry=registry,
        )
        self.feed = feed if feed is not None else ClusterEvents()

    @property
    def recent(self) -> list[dict]:
        return self.feed.recent(kinds=("health",))

    def record(self, worker_id: str, change: str, reason: str) -> None:
        level = logging.INFO if change in HEALTHY_CHANGES else logging.WARNING
        log.log(level, "worker %s: %s (%s)", worker_id, change, reason)
        self.transitions.labels(worker_id, change).inc()
        self.feed.record("health", change, reason, worker_id=worker_id)
