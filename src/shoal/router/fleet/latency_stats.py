"""What clients feel from one worker, as the router measures it on the streams it relays."""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.1  # weight of the newest sample in the moving means


@dataclass
class LatencyStats:
    """Exponentially weighted means of time to first token and of the gap between tokens (seconds).
    Invariant: a mean is None exactly when its sample count is 0."""

    ttft_s: float | None = None
    itl_s: float | None = None
    ttft_samples: int = 0
    itl_samples: int = 0

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_s = seconds if self.ttft_s is None else self.ttft_s + ALPHA * (seconds - self.ttft_s)
        self.ttft_samples += 1

    def observe_itl(self, seconds: float) -> None:
        self.itl_s = seconds if self.itl_s is None else self.itl_s + ALPHA * (seconds - self.itl_s)
        self.itl_samples += 1
