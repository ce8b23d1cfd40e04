"""Speculative decoding's settings: one frozen dataclass, the engine config's `speculative` field
(YAML `speculative: {method: ngram}`, flag `--speculative '{"method": "ngram"}'`, Python
`EngineConfig(speculative=SpeculativeConfig(method="ngram"))`); field names are vLLM's
speculative_config keys."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

SPECULATIVE_METHODS = (None, "ngram", "draft_model")


@dataclass(frozen=True)
class SpeculativeConfig:
    """How decoding sequences draft tokens for the target to verify in one step. A draft is kept
    exactly as far as it equals what the sequence samples itself, so no setting here changes the
    output, only the speed.

    method None drafts only a request's predicted output (OpenAI's `prediction`); "ngram" drafts by
    prompt lookup (the tokens after the latest earlier occurrence of the last prompt_lookup_max..
    prompt_lookup_min tokens: shoal.engine.ngram_drafter); "draft_model" runs `model`, a model with
    the target's tokenizer (a smaller one, or the same weights quantized), ahead of each sequence
    (shoal.engine.draft_model). At most num_speculative_tokens are drafted a step. With more than
    disable_by_batch_size sequences running the step is compute-bound and nothing is drafted.
    """

    method: str | None = None
    model: str | None = None
    num_speculative_tokens: int = 8
    prompt_lookup_min: int = 3
    prompt_lookup_max: int = 5
    disable_by_batch_size: int = 8

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be ngram or draft_model, got {self.method!r}")
        if (self.method == "draft_model") != (self.model is not None):
            raise ValueError("a speculative model is given exactly when the method is draft_model")
        if self.num_speculative_tokens < 1 or not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("num_speculative_tokens must be positive and 1 <= prompt_lookup_min <= prompt_lookup_max")
        if self.disable_by_batch_size < 0:
            raise ValueError("disable_by_batch_size must not be negative")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        """Unknown keys are errors."""
        unknown = sorted(set(raw) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"unknown speculative config keys: {unknown}")
        return cls(**raw)
