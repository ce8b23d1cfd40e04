"""Request bodies of the OpenAI-compatible endpoints, validated with pydantic, and their mapping to
SamplingParams. Unknown fields are ignored (as OpenAI's own server does); wrong types and values
are 400s."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from shoal.engine.sampling_params import SamplingParams


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat completions (OpenAI names, vLLM extensions)."""

    model: str
    n: int = Field(1, ge=1, le=16)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = -1
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    # shoal extension, for failover: continue after these output tokens (n must be 1), of whose
    # text the client already has resume_text_offset characters (default: all).
    resume_token_ids: list[int] | None = None
    resume_text_offset: int | None = Field(None, ge=0)

    def sampling_params(self, max_tokens: int, logprobs: int | None, seed: int | None) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=max(self.top_k, 0),
            min_p=self.min_p,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=self.repetition_penalty,
            stop=tuple(stop),
            stop_token_ids=tuple(self.stop_token_ids or ()),
            seed=seed,
            logprobs=logprobs,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
        )


class CompletionRequest(SamplingFields):
    prompt: str | list[int]
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False


class ChatMessage(BaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict] | None = None

    def text(self) -> str:
        """Content as plain text; list content keeps its text parts."""
        if isinstance(self.content, list):
            return "".join(part.get("text", "") for part in self.content if part.get("type") == "text")
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
