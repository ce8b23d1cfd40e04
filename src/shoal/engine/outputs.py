"""What the engine reports per request and step, in vLLM's shape (RequestOutput / CompletionOutput)."""

from __future__ import annotations

from dataclasses import dataclass, field

from shoal.errors import ShoalError


@dataclass
class CompletionOutput:
    """Cumulative output of one request. `logprobs` holds, per token, {token_id: logprob} with the
    sampled token first and then the requested top alternatives."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, float]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Speculative drafts (a predicted output's tokens, or prompt lookup's) kept and refused so far.
    kept_drafts: int = 0
    refused_drafts: int = 0


@dataclass
class RequestOutput:
    """One step's news for one request: the deltas plus the cumulative state.

    `seed` is the seed actually used (drawn by the engine if the request had none); resubmitting
    prompt + token_ids with that seed continues the stream exactly. `error` is set (and
    finish_reason is "error") when this request, and only this one, ended in error: an
    EngineRequestError when the engine failed it, an InvalidRequestError when its grammar left no
    token of the model's vocabulary to go on with.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    seed: int
    num_cached_tokens: int = 0
    new_token_ids: list[int] = field(default_factory=list)
    new_text: str = ""
    error: ShoalError | None = None
