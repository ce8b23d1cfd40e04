"""Measured throughput of one engine: moving prefill and decode speeds from step timings."""

from __future__ import annotations


class DecayedRate:
    """tokens / seconds over recent observations, each older one weighing (1 - decay) less.

    A ratio of sums, not a mean of ratios: a step that computes few tokens weighs little, so the
    fixed cost of a step cannot make a handful of tokens look like a fast rate."""

    def __init__(self, decay: float):
        self.decay = decay
        self.tokens = 0.0
        self.seconds = 0.0

    def add(self, tokens: float, seconds: float) -> None:
        self.tokens = self.tokens * (1 - self.decay) + tokens
        self.seconds = self.seconds * (1 - self.decay) + seconds

    @property
    def rate(self) -> float | None:
        return self.tokens / self.seconds if self.seconds > 0 and self.tokens > 0 else None


class SpeedEstimator:
    """Prefill and decode speeds of this engine, as routers use them.

    A pure decode step (D sequences given T tokens in t seconds: T = D unless they speculated) feeds
    the decode rate (T / t), the decode step time t and the tokens a sequence gets a step (T / D:
    1 plus the drafts it kept, so the measured acceptance). A step with P prompt tokens charges its
    D sequences' tokens at the current decode rate and the rest of t to prefill. Invariant: figures are None
    until observed or seeded by calibration, then positive.

    `decode_step_noise` is how far decode steps fall from the step time reported before them,
    relative to it (the root of a moving mean of squared relative deviations, same decay): what a
    router comparing this engine's reported step with another's must allow for. A batch that
    changes size and a CPU shared with other processes both raise it. A step counts as at most a
    100 % deviation: one stall (a page fault, a collection, the process descheduled) moves it by
    no more than a step twice as long would. None before a decode step has been compared with a
    reported one.
    """

    def __init__(self, decay: float = 0.05):
        self.decay = decay
        self.prefill = DecayedRate(decay)
        self.decode = DecayedRate(decay)
        self.tokens_per_step = DecayedRate(decay)
        self.decode_step_s: float | None = None
        self._step_deviation_sq: float | None = None

    @property
    def decode_step_noise(self) -> float | None:
        return None if self._step_deviation_sq is None else self._step_deviation_sq**0.5

    @property
    def prefill_tokens_per_s(self) -> float | None:
        return self.prefill.rate

    @property
    def decode_tokens_per_s(self) -> float | None:
        return self.decode.rate

    @property
    def decode_tokens_per_step(self) -> float | None:
        """The tokens a decoding sequence gets a step (1 without speculation)."""
        return self.tokens_per_step.rate

    def observe(self, prefill_tokens: int, decode_tokens: int, seconds: float, produced: int | None = None) -> None:
        """A step's prompt tokens, decoding sequences and seconds; `produced` is the tokens those
        sequences were given (decode_tokens when None: one each)."""
        if seconds <= 0:
            return
        produced = decode_tokens if produced is None else produced
        if prefill_tokens == 0:
            if decode_tokens:
                self.decode.add(produced, seconds)
                self.tokens_per_step.add(produced, decode_tokens)
                step = self.decode_step_s
                if step is None:
                    self.decode_step_s = seconds
                    return
                deviation_sq = min(1.0, ((seconds - step) / step) ** 2)
                known = self._step_deviation_sq
                self._step_deviation_sq = deviation_sq if known is None else known + self.decay * (deviation_sq - known)
                self.decode_step_s = step + self.decay * (seconds - step)
            return
        decode_rate = self.decode.rate
        decode_share = produced / decode_rate if decode_rate else 0.0
        self.prefill.add(prefill_tokens, max(0.0, seconds - decode_share))

    def step_seconds(self, prefill_tokens: int, decode_tokens: int) -> float | None:
        """How long a step with these tokens should take: its prompt tokens at the prefill rate,
        plus the decode step time if it decodes too. None while a figure it needs is unknown."""
        prefill_rate = self.prefill.rate
        if (prefill_tokens and prefill_rate is None) or (decode_tokens and self.decode_step_s is None):
            return None
        prefill_s = prefill_tokens / prefill_rate if prefill_tokens else 0.0
        return (prefill_s + (self.decode_step_s if decode_tokens else 0.0)) or None

    def seed(self, prefill_tokens_per_s: float, decode_tokens_per_s: float, decode_step_s: float) -> None:
        """Starts from calibrated figures (worth one second of observations each)."""
        self.prefill.add(prefill_tokens_per_s, 1.0)
        self.decode.add(decode_tokens_per_s, 1.0)
        self.decode_step_s = decode_step_s
