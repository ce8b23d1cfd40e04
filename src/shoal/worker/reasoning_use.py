"""A chat request's reasoning output as this worker serves it: whether the model's reasoning section
is split off its answer, and how the split reaches the client.

The model's family says how it writes reasoning: between markers (`Family.reasoning_markers`: Qwen3
and SmolLM3 write `<think>...</think>`), or in harmony's analysis channel (`Family.harmony`:
gpt-oss, read by HarmonyParser, which also reads its tool calls); a model of another family has no
reasoning to split, whatever the request says. The request's switches mean what they mean to SGLang
and vLLM:
- `separate_reasoning` (default true): false leaves the output whole, markers and all, in content
  (a 400 for a harmony model, whose channels are always read);
- `include_reasoning` (default true): false drops the reasoning from the reply (it is generated all
  the same, and its tokens counted);
- `stream_reasoning` (default true): false sends a stream's reasoning in one delta, once its section
  closes (or the output ends).

Whether the output begins inside a section is read from the prompt: the text the output continues
ends with the start marker (whitespace aside), as the generation prompt of Qwen3's thinking models
does; a request that continues its final assistant message continues a section that message opened
and did not close. A harmony output continues the prompt's last message (from its last `<|start|>`:
`<|start|>assistant` after a generation prompt), which its parser reads first.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.errors import InvalidRequestError
from shoal.model.tokenizer import Tokenizer
from shoal.worker.harmony_parser import START, HarmonyParser
from shoal.worker.protocol import ChatCompletionRequest
from shoal.worker.reasoning_parser import ReasoningParser
from shoal.worker.reasoning_tokens import ReasoningTokens


@dataclass(frozen=True)
class ReasoningUse:
    """Invariant: the request splits reasoning off (separate_reasoning) and the model writes it,
    between `markers` or, where `harmony`, in harmony messages (markers None); `opened` says
    whether a marked output begins inside a section, `opening` is the harmony message the prompt
    leaves open; `skip_special_tokens` is False where a marker is a special token that decoding
    would otherwise drop (always, for harmony)."""

    markers: tuple[str, str] | None
    opened: bool
    include: bool
    stream: bool
    skip_special_tokens: bool
    tokenizer: Tokenizer
    harmony: bool = False
    opening: str = ""

    @classmethod
    def of(
        cls,
        body: ChatCompletionRequest,
        markers: tuple[str, str] | None,
        tokenizer: Tokenizer,
        prompt: str,
        harmony: bool = False,
    ) -> ReasoningUse | None:
        """None when nothing is split off: a model without markers that does not write harmony,
        or separate_reasoning false. `prompt` is the request's prompt text. Raises
        InvalidRequestError for separate_reasoning false with a harmony model."""
        if harmony:
            if not body.separate_reasoning:
                raise InvalidRequestError(
                    "separate_reasoning false is not served for this model: its harmony channels are always read",
                    param="separate_reasoning",
                )
            return cls(
                markers=None,
                opened=False,
                include=body.include_reasoning,
                stream=body.stream_reasoning,
                skip_special_tokens=False,
                tokenizer=tokenizer,
                harmony=True,
                opening=prompt[prompt.rfind(START) :] if START in prompt else "",
            )
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
        """The parser of a marked section (not harmony)."""
        return ReasoningParser(self.markers, opened=self.opened)

    def harmony_parser(self, reads_calls: bool) -> HarmonyParser:
        """The parser of a harmony output; `reads_calls`: the request reads tool calls."""
        return HarmonyParser(reads_calls, self.opening)

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
