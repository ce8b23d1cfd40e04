"""Every change of a worker's health, logged, counted (Prometheus) and kept for operators."""
from __future__ import annotations

import logging
import time
from collections import deque

from prometheus_client import CollectorRegistry, Counter

log = logging.getLogger("shoal.router.health")

RECENT = 256


class HealthEvents:
    """Invariant: `recent` holds the latest RECENT changes, oldest first; the counter counts all."""

    def __init__(self, registry: CollectorRegistry):
        self.transitions = Counter("shoal_router_worker_transitions", "Health state changes of workers",
                                   ["worker", "change"], registry=registry)
        self.recent: deque[dict] = deque(maxlen=RECENT)

    def record(self, worker_id: str, change: str, reason: str) -> None:
        level = logging.INFO if change in ("up", "registered", "rejoined", "breaker_closed") else logging.WARNING
        log.log(level, "worker %s: %s (%s)", worker_id, change, reason)
        self.transitions.labels(worker_id, change).inc()
        self.recent.append({"time": time.time(), "worker_id": worker_id, "change": change, "reason": reason})
