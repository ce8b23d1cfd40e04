"""Adaptive batch size: admits as many sequences as keep the inter-token latency under a target."""

from __future__ import annotations


class BatchSizeController:
    """Additive-increase / multiplicative-decrease on the number of running sequences.

    After each decoding step of duration d: if d exceeds the target, the limit shrinks by a quarter
    (never below the floor); if d is under 80% of the target and requests are waiting, it grows by
    one. With no target the limit stays at the maximum. Invariant: floor <= limit <= maximum.
    """

    def __init__(self, maximum: int, target_ms: float | None, floor: int = 1):
        self.maximum = maximum
        self.floor = min(floor, maximum)
        self.target_ms = target_ms
        self.limit = maximum if target_ms is None else max(self.floor, min(maximum, 8))

    def observe(self, step_ms: float, running: int, waiting: int) -> None:
        """running: sequences in the step just measured; waiting: requests queued after it."""
        if self.target_ms is None or running == 0:
            return
        if step_ms > self.target_ms:
            self.limit = max(self.floor, min(self.limit, running) * 3 // 4)
        elif step_ms < 0.8 * self.target_ms and waiting and running >= self.limit:
            self.limit = min(self.maximum, self.limit + 1)
