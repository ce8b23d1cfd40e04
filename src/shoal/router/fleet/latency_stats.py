"""What clients feel from one worker, as the router measures it on the streams it relays."""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

ALPHA = 0.1  # weight of the newest sample in the moving means
RECENT_GAPS = 64  # the gaps between tokens whose median is the typical one


@dataclass
class LatencyStats:
    """Exponentially weighted means of time to first token and of the gap between tokens (seconds),
    and the latest gaps. Invariant: a mean is None exactly when its sample count is 0; `recent_itl`
    holds the latest RECENT_GAPS gaps at most."""

    ttft_s: float | None = None
    itl_s: float | None = None
    ttft_samples: int = 0
    itl_samples: int = 0
    recent_itl: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT_GAPS))

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_s = seconds if self.ttft_s is None else self.ttft_s + ALPHA * (seconds - self.ttft_s)
        self.ttft_samples += 1

    def observe_itl(self, seconds: float) -> None:
        self.itl_s = seconds if self.itl_s is None else self.itl_s + ALPHA * (seconds - self.itl_s)
        self.itl_samples += 1
        self.recent_itl.append(seconds)

    def typical_itl_s(self) -> float | None:
        """The median of the latest gaps: a stream's tokens wait for another request's prompt now and
        then (a long step), which moves the mean for a while but not this."""
        return statistics.median(self.recent_itl) if self.recent_itl else None
