"""Turns one request's sampled tokens into text deltas and decides when it stops."""

from __future__ import annotations

import llguidance

from shoal.engine.sampler import SampledToken
from shoal.engine.sampling_params import SamplingParams
from shoal.errors import InvalidRequestError
from shoal.model.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputStream:
    """Per-request detokenizer and stop checker, and the request's grammar matcher if it has one.

    Invariants: the matcher has consumed exactly the output tokens (a grammar that is complete
    finishes the request with "stop");  `text` is the decoded output with the stop string (and everything after it)
    removed unless include_stop_str_in_output; the text handed out so far (`emitted`) is always a
    prefix of the final text, because text that might be the start of a stop string is held back.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        params: SamplingParams,
        prompt_token_ids: list[int],
        eos_token_ids: tuple[int, ...],
        max_model_len: int,
        matcher: llguidance.LLMatcher | None = None,
    ):
        self.params = params
        self.matcher = matcher
        self.detokenizer = IncrementalDetokenizer(
            tokenizer, prompt_token_ids, skip_special_tokens=params.skip_special_tokens
        )
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.max_total_tokens = max_model_len
        self.num_prompt_tokens = len(prompt_token_ids)
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.num_tokens = 0
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.text = ""
        self.emitted = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def resume(self, token_ids: list[int], text_offset: int | None = None) -> None:
        """Takes output tokens generated elsewhere as already produced. `text_offset` is how much of
        their text was already handed out (None: all of it); the rest, held back there for a
        possible stop string or an unfinished character, is handed out from here."""
        if self.matcher is not None and not self.matcher.consume_tokens(token_ids):
            raise InvalidRequestError("resume_token_ids do not match the request's grammar", param="resume_token_ids")
        for token in token_ids:
            self.num_tokens += 1
            if self.logprobs is not None:
                self.logprobs.append({})
            self.text += self.detokenizer.add(token)
        self.emitted = len(self.text) if text_offset is None else min(text_offset, len(self.text))

    def banned_token_ids(self, ahead: int = 0) -> tuple[int, ...]:
        """Tokens that may not be sampled yet (stop tokens before min_tokens), for the token
        `ahead` places after the next (a draft's)."""
        return tuple(sorted(self.stop_ids)) if self.num_tokens + ahead < self.params.min_tokens else ()

    def append(self, sampled: SampledToken) -> None:
        """Adds one token; sets finish_reason when the request is done."""
        token = sampled.token_id
        self.num_tokens += 1
        if self.logprobs is not None:
            self.logprobs.append({token: sampled.logprob, **(sampled.top_logprobs or {})})
            self.cumulative_logprob += sampled.logprob
        if token in self.stop_ids:
            self.finish_reason, self.stop_reason = "stop", token
            self.text += self.detokenizer.flush()
            return
        self.text += self.detokenizer.add(token)
        if self.params.stop and self._truncate_at_stop_string():
            return
        if self.matcher is not None and self._grammar_ended(token):
            return
        if (
            self.num_tokens >= self.params.max_tokens
            or self.num_prompt_tokens + self.num_tokens >= self.max_total_tokens
        ):
            self.finish_reason = "length"
            self.text += self.detokenizer.flush()

    def _grammar_ended(self, token: int) -> bool:
        """Advances the matcher; the request stops once the grammar is complete. A token the
        grammar refused (only possible when every token was refused) ends it with an error."""
        if not self.matcher.consume_token(token):
            self.finish_reason = "error"
        elif self.matcher.is_stopped():
            self.finish_reason = "stop"
        else:
            return False
        self.text += self.detokenizer.flush()
        return True

    def _truncate_at_stop_string(self) -> bool:
        window_start = max(0, self.emitted - self.holdback)
        found = [(self.text.find(s, window_start), s) for s in self.params.stop]
        found = [(i, s) for i, s in found if i >= 0]
        if not found:
            return False
        index, stop = min(found)
        self.text = self.text[: index + len(stop)] if self.params.include_stop_str_in_output else self.text[:index]
        self.finish_reason, self.stop_reason = "stop", stop
        return True

    def take_new_text(self) -> str:
        """Text not handed out yet that can no longer become part of a stop string."""
        end = len(self.text) if self.finish_reason else max(self.emitted, len(self.text) - self.holdback)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
