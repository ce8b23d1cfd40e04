"""What the router's clients saw lately, for live charts: running totals (requests finished and
failed, output tokens relayed, overall and per worker) and the latest latency observations (time
to first token, between tokens, end to end) within a rolling window, from which percentiles are
read. The request path feeds it (RequestTelemetry); the dashboard's sampler reads it every second.
Prometheus histograms say the same over all time; this says it for the last few seconds.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, deque

from shoal.percentile import percentiles

PERCENTILES = (50, 90, 99)


class RollingSamples:
    """Invariants: holds at most `max_samples` (value, time) pairs, the latest; reads see only
    those observed within the last `window_s` seconds."""

    def __init__(self, window_s: float, max_samples: int):
        self.window_s = window_s
        self.max_samples = max_samples
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, value: float, now: float) -> None:
        self._samples.append((now, value))

    def _prune(self, now: float) -> None:
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()

    def values(self, now: float) -> list[float]:
        self._prune(now)
        return [value for _, value in self._samples]

    def percentiles(self, now: float, qs: tuple[float, ...] = PERCENTILES) -> dict[str, float | None]:
        """{"p50": ..., "p90": ..., "p99": ...} over the window (None where nothing was observed)."""
        ordered = sorted(self.values(now))
        return {f"p{q:g}": value for q, value in zip(qs, percentiles(ordered, qs))}


class RequestWindow:
    """Invariants: the totals only grow; each rolling series holds at most `max_samples`
    observations, none older than `window_s` once read. Safe to feed from any thread."""

    def __init__(self, window_s: float = 10.0, max_samples: int = 4096):
        self.window_s = window_s
        self.finished = 0
        self.failed = 0
        self.tokens = 0
        self.tokens_by_worker: Counter[str] = Counter()
        self.ttft = RollingSamples(window_s, max_samples)
        self.itl = RollingSamples(window_s, max_samples)
        self.e2e = RollingSamples(window_s, max_samples)
        self._lock = threading.Lock()

    def first_token(self, seconds: float, now: float | None = None) -> None:
        with self._lock:
            self.ttft.add(seconds, time.monotonic() if now is None else now)

    def relayed(self, worker_id: str | None, count: int, gap_s: float | None, now: float | None = None) -> None:
        """`count` output tokens relayed from `worker_id`; `gap_s` is the time per token since the
        previous ones (None for a stream's first)."""
        with self._lock:
            self.tokens += count
            if worker_id is not None:
                self.tokens_by_worker[worker_id] += count
            if gap_s is not None:
                self.itl.add(gap_s, time.monotonic() if now is None else now)

    def request_finished(self, status: int, seconds: float, now: float | None = None) -> None:
        with self._lock:
            self.finished += 1
            if status >= 400:
                self.failed += 1
            else:
                self.e2e.add(seconds, time.monotonic() if now is None else now)

    def snapshot(self, now: float | None = None) -> dict:
        """Totals and the window's percentiles now."""
        now = time.monotonic() if now is None else now
        with self._lock:
            return {
                "finished": self.finished,
                "failed": self.failed,
                "tokens": self.tokens,
                "tokens_by_worker": dict(self.tokens_by_worker),
                "ttft": self.ttft.percentiles(now),
                "itl": self.itl.percentiles(now),
                "e2e": self.e2e.percentiles(now),
            }

    def forget_worker(self, worker_id: str) -> None:
        with self._lock:
            self.tokens_by_worker.pop(worker_id, None)

    def check_integrity(self) -> None:
        with self._lock:
            assert 0 <= self.failed <= self.finished and self.tokens >= sum(self.tokens_by_worker.values())
            for series in (self.ttft, self.itl, self.e2e):
                assert len(series) <= series.max_samples
