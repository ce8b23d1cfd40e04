"""Sampling parameters of one request, with the ranges vLLM and the OpenAI API accept."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.engine.structured_outputs import StructuredOutputs
from shoal.errors import InvalidSamplingParamsError

MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for logit_bias values


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token and when to stop. temperature == 0 means greedy.

    The token at absolute position p is drawn with randomness derived only from (seed, p), so a
    request is reproducible alone, batched, preempted, or resumed elsewhere from a token prefix.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    min_tokens: int = 0
    seed: int | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # What the output must match (a JSON schema, regex, choice or grammar); None: free text.
    structured_outputs: StructuredOutputs | None = None
    # OpenAI's logit_bias: (token id, value) pairs added to the row's logits before penalties and the
    # grammar's mask (-100 all but forbids a token, 100 all but forces it).
    logit_bias: tuple[tuple[int, float], ...] = ()
    # OpenAI's predicted output, as token ids: drafts for speculative decoding (never a change of
    # the tokens: a draft is kept only where it is the token the request samples itself).
    predicted_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        object.__setattr__(self, "logit_bias", tuple((int(t), float(v)) for t, v in self.logit_bias))
        object.__setattr__(self, "predicted_token_ids", tuple(self.predicted_token_ids))
        self._validate()

    def _validate(self) -> None:
        checks = [
            (self.max_tokens >= 1, "max_tokens", "must be at least 1"),
            (self.temperature >= 0.0, "temperature", "must be non-negative"),
            (0.0 < self.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (self.top_k >= 0 or self.top_k == -1, "top_k", "must be -1 (off), 0 (off) or positive"),
            (0.0 <= self.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (self.repetition_penalty > 0.0, "repetition_penalty", "must be positive"),
            (-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (0 <= self.min_tokens <= self.max_tokens, "min_tokens", "must be in [0, max_tokens]"),
            (
                self.logprobs is None or 0 <= self.logprobs <= MAX_LOGPROBS,
                "logprobs",
                f"must be in [0, {MAX_LOGPROBS}]",
            ),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "must be non-empty strings"),
            (
                all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
                "stop_token_ids",
                "must be non-negative ints",
            ),
            (self.seed is None or isinstance(self.seed, int), "seed", "must be an integer"),
            (
                all(t >= 0 and -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS for t, v in self.logit_bias),
                "logit_bias",
                f"must map token ids to values in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]",
            ),
        ]
        for ok, name, rule in checks:
            if not ok:
                raise InvalidSamplingParamsError(f"{name} {rule}, got {getattr(self, name)!r}", param=name)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
