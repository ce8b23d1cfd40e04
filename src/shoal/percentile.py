"""The one percentile definition of shoal: the dashboard, `shoal bench`, the simulator and the
benchmarks all report this one, so their p99s can be compared.

It interpolates linearly between the closest ranks, as numpy's default ("linear") does: for n
ascending values, the q-th percentile sits at rank (n - 1) * q / 100. Imports nothing heavy.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def percentiles(values: Iterable[float], qs: Sequence[float]) -> list[float | None]:
    """The q-th percentile (0 <= q <= 100) for each of `qs`; None each when there are no values."""
    ordered = sorted(values)
    if not ordered:
        return [None] * len(qs)
    found = []
    for q in qs:
        if not 0 <= q <= 100:
            raise ValueError(f"a percentile must be within 0 and 100, not {q}")
        rank = (len(ordered) - 1) * q / 100
        low = int(rank)
        high = min(low + 1, len(ordered) - 1)
        found.append(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))
    return found


def percentile(values: Iterable[float], q: float) -> float | None:
    """The q-th percentile (0 <= q <= 100) of `values`, None if there are none."""
    return percentiles(values, (q,))[0]
