"""Which new traces are recorded: the first `per_second` of each second, then `ratio` of the rest
(the reservoir-plus-rate rule of AWS X-Ray's and Jaeger's samplers). A quiet service traces every
request; a busy one traces a steady trickle, so tracing costs a bounded share of its CPU.
Invariant: at most `per_second` + `ratio` × (the rest) new traces are recorded in any one-second
window (threads racing on it only blur the count)."""

from __future__ import annotations

import random
import time


class TraceBudget:
    def __init__(self, per_second: float, ratio: float):
        self.per_second = per_second
        self.ratio = ratio
        self._window_ends = 0.0
        self._used = 0

    def admit(self) -> bool:
        now = time.monotonic()
        if now >= self._window_ends:
            self._window_ends, self._used = now + 1.0, 0
        if self._used < self.per_second:
            self._used += 1
            return True
        return random.random() < self.ratio
