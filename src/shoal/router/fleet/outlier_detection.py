"""Gray failures: a worker whose latency is `factor` times its peers' median is an outlier.

Latencies are compared among the workers serving one model on one engine (a batching engine's
inter-token latency is not a serial one's) and normalised by each worker's calibrated
single-stream step time when every compared worker reports one, so a slower kind of hardware is not
a failure; only a worker slow for its kind is.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping


def outliers(latencies: Mapping[str, float], factor: float, min_workers: int) -> set[str]:
    """Worker ids whose latency exceeds factor × the median; none when fewer than min_workers
    have a measurement (with two, the median cannot tell which one is wrong)."""
    if len(latencies) < max(min_workers, 3):
        return set()
    median = statistics.median(latencies.values())
    return {worker for worker, latency in latencies.items() if latency > factor * median}


def normalised(latencies: Mapping[str, float], step_s: Mapping[str, float | None]) -> dict[str, float]:
    """Latencies in units of each worker's own step time, if all have one; else as they are."""
    if all(step_s.get(w) for w in latencies):
        return {w: latency / step_s[w] for w, latency in latencies.items()}
    return dict(latencies)
