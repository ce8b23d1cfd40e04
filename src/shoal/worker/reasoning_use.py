"""A chat request's reasoning output as this worker serves it: whether the model's reasoning section
is split off its answer, and how the split reaches the client.

The markers come from the model's family (`Family.reasoning_markers`: Qwen3 and SmolLM3 write
`<think>...</think>`); a model of another family has no reasoning to split, whatever the request
says. The request's switches mean what they mean to SGLang and vLLM:
- `separate_reasoning` (default true): false leaves the output whole, markers and all, in content;
- `include_reasoning` (default true): false drops the reasoning from the reply (it is generated all
  the same, and its tokens counted);
- `stream_reasoning` (default true): false sends a stream's reasoning in one delta, once its section
  closes (or the output ends).

Whether the output begins inside a section is read from the prompt: the text the output continues
ends with the start marker (whitespace aside), as the generation prompt of Qwen3's thinking models
does; a request that continues its final assistant message continues a section that message opened
and did not close.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.model.tokenizer import Tokenizer
from shoal.worker.protocol import ChatCompletionRequest
from shoal.worker.reasoning_parser import ReasoningParser
from shoal.worker.reasoning_tokens import ReasoningTokens


@dataclass(frozen=True)
class ReasoningUse:
    """Invariant: the request splits reasoning off (separate_reasoning) and the model has markers;
    `opened` says whether its output begins inside a section; `skip_special_tokens` is False where a
    marker is a special token that decoding would otherwise drop."""

    markers: tuple[str, str]
    opened: bool
    include: bool
    stream: bool
    skip_special_tokens: bool
    tokenizer: Tokenizer

    @classmethod
    def of(
        cls, body: ChatCompletionRequest, markers: tuple[str, str] | None, tokenizer: Tokenizer, prompt: str
    ) -> ReasoningUse | None:
        """None when nothing is split off: a model without markers, or separate_reasoning false.
        `prompt` is the request's prompt text."""
        if markers is None or not body.separate_reasoning:
            return None
        return cls(
            markers=markers,
            opened=_opened(body, markers, prompt),
            include=body.include_reasoning,
            stream=body.stream_reasoning,
            skip_special_tokens=not any(_is_special_token(tokenizer, marker) for marker in markers),
            tokenizer=tokenizer,
        )

    def parser(self) -> ReasoningParser:
        return ReasoningParser(self.markers, opened=self.opened)

    def tokens(self, prompt_token_ids: list[int], skip_special_tokens: bool) -> ReasoningTokens:
        return ReasoningTokens(self.tokenizer, prompt_token_ids, skip_special_tokens)


def _opened(body: ChatCompletionRequest, markers: tuple[str, str], prompt: str) -> bool:
    """Whether the output begins inside a reasoning section the prompt opened."""
    if not body.continue_final_message:
        return prompt.rstrip().endswith(markers[0])
    continued = body.messages[-1].text()
    head = prompt[: len(prompt) - len(continued)] if continued and prompt.endswith(continued) else prompt
    parser = ReasoningParser(markers, opened=head.rstrip().endswith(markers[0]))
    parser.feed(continued)
    return parser.in_reasoning


def _is_special_token(tokenizer: Tokenizer, text: str) -> bool:
    """Whether `text` is one token that decoding with skip_special_tokens drops."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return len(ids) == 1 and tokenizer.decode(ids, skip_special_tokens=True) == ""
