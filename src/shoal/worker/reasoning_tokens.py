"""Which of a choice's output tokens are reasoning tokens (`reasoning_tokens` in usage).

A token is a reasoning token when its text lies, at least in part, inside a reasoning section
(markers included: a `<think>` section, or a harmony analysis message); a token with no text of its
own yet (part of a character that a later token completes) counts where its text will begin. Each
token's text comes from a detokenizer of its own fed the same tokens as the engine's (the same
tokenizer, prompt and special-token setting), so the count is the same whether the output was
streamed, given whole, or resumed on another worker from its tokens so far.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from shoal.model.tokenizer import IncrementalDetokenizer, Tokenizer


class ReasoningTokens:
    """Invariant: `_spans[i]` is the span of output text token i produced, in the same characters
    as the output text the engine gives out (token i+1's span begins where token i's ends)."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool):
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self._spans: list[tuple[int, int]] = []
        self._chars = 0

    def add(self, token_ids: Sequence[int]) -> None:
        for token in token_ids:
            begin = self._chars
            self._chars += len(self._detokenizer.add(token))
            self._spans.append((begin, self._chars))

    def count(self, sections: Sequence[tuple[int, int | None]]) -> int:
        """Tokens whose text lies in any of `sections` (a parser's, in output characters; an end
        None is a section still open)."""
        return sum(1 for span in self._spans if any(_within(span, section) for section in sections))


def _within(span: tuple[int, int], section: tuple[int, int | None]) -> bool:
    begin, stop = span
    start, end = section[0], math.inf if section[1] is None else section[1]
    return begin < end and (stop > start or (begin == stop and begin >= start))
