"""The router's recent history for the dashboard's charts: once a second, a sample of what clients
saw (requests finished and failed per second, output tokens relayed per second, time to first
token, inter-token and end-to-end latency percentiles over the request window) and of the load
(requests in flight and queued, workers serving), kept in a ring buffer (ten minutes by default).
It also keeps each worker's relayed tokens per second over the last interval, for the worker table.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from shoal.observability.request_window import RequestWindow

log = logging.getLogger(__name__)

DEFAULT_INTERVAL_S = 1.0
DEFAULT_KEEP = 600  # samples: ten minutes at one a second


@dataclass(frozen=True)
class LoadNow:
    """The load figures a sample reads, by callables so the sampler needs no router object."""

    in_flight: Callable[[], int]
    queued: Callable[[], int]
    workers: Callable[[], tuple[int, int]]  # (available, known)


class TimeSeries:
    """Invariant: at most `keep` samples, in increasing `time`, the latest kept."""

    def __init__(self, keep: int = DEFAULT_KEEP):
        self.keep = keep
        self._samples: deque[dict] = deque(maxlen=keep)

    def __len__(self) -> int:
        return len(self._samples)

    def add(self, sample: dict) -> None:
        if self._samples and sample["time"] <= self._samples[-1]["time"]:
            return  # a clock step back: keep the series ordered
        self._samples.append(sample)

    def latest(self) -> dict | None:
        return self._samples[-1] if self._samples else None

    def since(self, after: float | None = None) -> list[dict]:
        """Samples taken after `after` (seconds since the epoch; all when None), oldest first."""
        return [s for s in self._samples if after is None or s["time"] > after]

    def check_integrity(self) -> None:
        times = [s["time"] for s in self._samples]
        assert len(times) <= self.keep and times == sorted(set(times))


@dataclass
class Totals:
    """The window's running totals at one sample (to difference into rates)."""

    at: float  # monotonic seconds
    finished: int = 0
    failed: int = 0
    tokens: int = 0
    tokens_by_worker: dict[str, int] = field(default_factory=dict)


def _rate(now: int, before: int, seconds: float) -> float:
    return max(now - before, 0) / seconds if seconds > 0 else 0.0


class Sampler:
    """Turns the request window's totals into per-second rates once per `interval_s`.
    Invariant: `worker_rates` holds only workers that relayed tokens in the last interval."""

    def __init__(
        self,
        window: RequestWindow,
        load: LoadNow,
        series: TimeSeries | None = None,
        interval_s: float = DEFAULT_INTERVAL_S,
    ):
        self.window = window
        self.load = load
        self.series = series if series is not None else TimeSeries()
        self.interval_s = interval_s
        self.previous = Totals(time.monotonic())
        self.worker_rates: dict[str, float] = {}
        self.on_sample: Callable[[], None] = lambda: None  # runs after each sample (cluster bookkeeping)

    def sample(self, now: float | None = None, wall: float | None = None) -> dict:
        """Takes one sample (monotonic `now`, epoch `wall`), adds it to the series and returns it."""
        now = time.monotonic() if now is None else now
        wall = time.time() if wall is None else wall
        snapshot = self.window.snapshot(now)
        seconds = now - self.previous.at
        before = self.previous
        available, known = self.load.workers()
        sample = {
            "time": round(wall, 3),
            "requests_per_s": _rate(snapshot["finished"], before.finished, seconds),
            "errors_per_s": _rate(snapshot["failed"], before.failed, seconds),
            "tokens_per_s": _rate(snapshot["tokens"], before.tokens, seconds),
            "in_flight": self.load.in_flight(),
            "queued": self.load.queued(),
            "workers_available": available,
            "workers": known,
        }
        for name in ("ttft", "itl", "e2e"):
            for quantile, value in snapshot[name].items():
                sample[f"{name}_{quantile}_s"] = value
        self.worker_rates = {
            worker: _rate(tokens, before.tokens_by_worker.get(worker, 0), seconds)
            for worker, tokens in snapshot["tokens_by_worker"].items()
            if tokens > before.tokens_by_worker.get(worker, 0)
        }
        self.previous = Totals(
            now, snapshot["finished"], snapshot["failed"], snapshot["tokens"], snapshot["tokens_by_worker"]
        )
        self.series.add(sample)
        return sample

    async def run(self) -> None:
        """Samples every interval, forever; a failed sample is logged and skipped."""
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                self.sample()
                self.on_sample()
            except Exception:  # the charts miss a point; the router carries on
                log.exception("dashboard sample failed")
