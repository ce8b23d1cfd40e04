"""Measured throughput of one engine: moving averages of prefill and decode speed."""
from __future__ import annotations


class SpeedEstimator:
    """Exponential moving averages from step timings.

    A step that computes P prompt tokens and D decode tokens in t seconds is split in two: a pure
    decode step sets the decode figures directly (D / t tokens/s, and t as the inter-token latency
    at that batch size); a step with prompt work charges D tokens at the current decode cost and
    the rest of t to prefill (at least a tenth of t, so noise cannot make prefill look free).
    Invariant: every figure is None until observed (or seeded by calibration), then positive.
    """

    def __init__(self, alpha: float = 0.2):
        self.alpha = alpha
        self.prefill_tokens_per_s: float | None = None
        self.decode_tokens_per_s: float | None = None
        self.decode_step_s: float | None = None

    def _average(self, current: float | None, sample: float) -> float:
        return sample if current is None else current + self.alpha * (sample - current)

    def observe(self, prefill_tokens: int, decode_tokens: int, seconds: float) -> None:
        if seconds <= 0:
            return
        if prefill_tokens == 0:
            if decode_tokens:
                self.decode_tokens_per_s = self._average(self.decode_tokens_per_s, decode_tokens / seconds)
                self.decode_step_s = self._average(self.decode_step_s, seconds)
            return
        decode_share = decode_tokens / self.decode_tokens_per_s if self.decode_tokens_per_s else 0.0
        prefill_seconds = max(seconds - decode_share, 0.1 * seconds)
        self.prefill_tokens_per_s = self._average(self.prefill_tokens_per_s, prefill_tokens / prefill_seconds)
