"""When requests may start: an open loop (Poisson or evenly spaced at a rate) or a closed loop
(everything at once, `concurrency` in flight)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class ArrivalProcess:
    """`poisson`: exponential gaps with mean 1/rate; `fixed`: gaps of exactly 1/rate; `closed`: all
    at t = 0, so the concurrency cap alone paces them. The first arrival is at t = 0 and times never
    decrease. `concurrency` caps requests in flight under any kind (None: no cap; `closed` needs it)."""

    kind: Literal["poisson", "fixed", "closed"]
    rate: float | None = None
    concurrency: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("poisson", "fixed", "closed"):
            raise ValueError(f"unknown arrival process {self.kind!r}")
        if self.kind != "closed" and not (self.rate and self.rate > 0):
            raise ValueError(f"{self.kind} arrivals need a rate above 0 requests/s")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        if self.kind == "closed" and self.concurrency is None:
            raise ValueError("a closed loop needs a concurrency")

    def times(self, count: int, rng: random.Random) -> list[float]:
        """`count` arrival times in seconds from the start of the run."""
        if self.kind == "closed":
            return [0.0] * count
        times, now = [], 0.0
        for _ in range(count):
            times.append(now)
            now += rng.expovariate(self.rate) if self.kind == "poisson" else 1.0 / self.rate
        return times
