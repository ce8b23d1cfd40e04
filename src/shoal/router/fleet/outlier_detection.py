"""Gray failures: a worker whose latency is `factor` times its peers' median is an outlier.

Latencies are compared among the workers serving one model on one engine (a batching engine's
inter-token latency is not a serial one's) and normalised by each worker's own expected step when
every compared worker reports one, so a slower kind of hardware is not a failure; only a worker slow
for its kind is. A batching worker's streams share its steps: the gap between its tokens is its
calibrated single-stream step, or its batch's share of its calibrated aggregate decode rate where
that is longer, so a worker given three streams where its peers have one is busy, not failing.
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


def expected_token_s(single_step_s: float | None, capability: float | None, streams: int) -> float | None:
    """The gap between a stream's tokens a worker's calibration predicts with `streams` running:
    its single-stream step, or the streams' share of its aggregate decode rate where longer (None
    without a calibrated step)."""
    if not single_step_s:
        return None
    return max(single_step_s, streams / capability) if capability else single_step_s
