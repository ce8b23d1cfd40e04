"""What clients feel from one worker, as the router measures it on the streams it relays."""

from __future__ import annotations

from dataclasses import dataclass

ALPHA = 0.1  # weight of the newest sample in the moving means
RATE_WINDOW_S = 1.0  # output tokens are counted over windows this long...
RATE_GAP_S = 0.5  # ...of steady output: a longer pause (the worker idle or stalled) starts a new one


@dataclass
class LatencyStats:
    """Exponentially weighted means of time to first token and of the gap between tokens (seconds),
    and of the worker's output rate over all its streams (tokens/s, over windows of steady output,
    so idle time does not count). Invariant: a mean is None exactly when its sample count is 0."""

    ttft_s: float | None = None
    itl_s: float | None = None
    ttft_samples: int = 0
    itl_samples: int = 0
    output_tokens_per_s: float | None = None
    rate_samples: int = 0
    _window_start: float = 0.0
    _window_tokens: int = 0
    _last_output_at: float | None = None

    def observe_ttft(self, seconds: float) -> None:
        self.ttft_s = seconds if self.ttft_s is None else self.ttft_s + ALPHA * (seconds - self.ttft_s)
        self.ttft_samples += 1

    def observe_itl(self, seconds: float) -> None:
        self.itl_s = seconds if self.itl_s is None else self.itl_s + ALPHA * (seconds - self.itl_s)
        self.itl_samples += 1

    def observe_output(self, tokens: int, now: float) -> None:
        """`tokens` relayed from this worker at `now`, on any of its streams."""
        steady = self._last_output_at is not None and now - self._last_output_at <= RATE_GAP_S
        self._last_output_at = now
        if not steady:  # a window opens here; these tokens were made before it
            self._window_start, self._window_tokens = now, 0
            return
        self._window_tokens += tokens
        elapsed = now - self._window_start
        if elapsed >= RATE_WINDOW_S:
            rate = self._window_tokens / elapsed
            mean = self.output_tokens_per_s
            self.output_tokens_per_s = rate if mean is None else mean + ALPHA * (rate - mean)
            self.rate_samples += 1
            self._window_start, self._window_tokens = now, 0
