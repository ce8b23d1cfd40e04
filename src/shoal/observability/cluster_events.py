"""The cluster's event feed: one timestamped list of what happened to the fleet, for operators and
the dashboard.

Kinds of event and who records them:
- `health`: a worker's health changed (up, down, registered, removed, ejected, rejoined,
  breaker_open / breaker_half_open / breaker_closed), from the router's HealthEvents;
- `failover`: a request moved off a worker (`migrated` mid-stream, with the tokens relayed so far;
  `retried` before its first byte), from the request's telemetry;
- `scaling`: an autoscaler or operator changed a model's replica count;
- `lifecycle`: a supervised worker started, became ready, joined or left the router, exited, or a
  warm spare was promoted (`shoal serve`'s supervisor).

Every event is a flat JSON-able dict: `seq` (increasing, unique), `time` (seconds since the epoch),
`kind`, `change`, `worker_id` (None when it is not about one worker), `reason` (a short sentence),
and whatever the kind adds (`model`, `tokens`, `trace_id`, `replicas`, `exit_code`, ...).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections import deque

KINDS = ("health", "failover", "scaling", "lifecycle")
DEFAULT_KEEP_PER_KIND = 256


class ClusterEvents:
    """Invariants: each kind keeps its latest `keep_per_kind` events, so a burst of one kind (many
    retries) never pushes another (an ejection) out of the feed; `seq` grows by one per event
    recorded, across kinds; reads return events oldest first. Safe to record from any thread."""

    def __init__(self, keep_per_kind: int = DEFAULT_KEEP_PER_KIND):
        self.keep_per_kind = keep_per_kind
        self._by_kind: dict[str, deque[dict]] = {kind: deque(maxlen=keep_per_kind) for kind in KINDS}
        self._seq = itertools.count(1)
        self._lock = threading.Lock()

    def record(self, kind: str, change: str, reason: str = "", worker_id: str | None = None, **details: object) -> dict:
        """Appends one event (now) and returns it."""
        if kind not in self._by_kind:
            raise ValueError(f"unknown event kind {kind!r}; one of {KINDS}")
        with self._lock:
            event = {
                "seq": next(self._seq),
                "time": time.time(),
                "kind": kind,
                "change": change,
                "worker_id": worker_id,
                "reason": reason,
                **details,
            }
            self._by_kind[kind].append(event)
        return event

    def recent(self, limit: int | None = None, after_seq: int = 0, kinds: tuple[str, ...] = KINDS) -> list[dict]:
        """The latest `limit` events (all held when None) of `kinds` with a seq above `after_seq`,
        oldest first."""
        with self._lock:
            streams = [list(self._by_kind[kind]) for kind in kinds if kind in self._by_kind]
        merged = [e for e in heapq.merge(*streams, key=lambda e: e["seq"]) if e["seq"] > after_seq]
        return merged if limit is None else merged[-limit:] if limit > 0 else []

    def last_seq(self) -> int:
        with self._lock:
            return max((stream[-1]["seq"] for stream in self._by_kind.values() if stream), default=0)

    def check_integrity(self) -> None:
        with self._lock:
            for kind, stream in self._by_kind.items():
                assert len(stream) <= self.keep_per_kind, kind
                assert all(e["kind"] == kind for e in stream), kind
                seqs = [e["seq"] for e in stream]
                assert seqs == sorted(set(seqs)), f"{kind}: seq not increasing"
