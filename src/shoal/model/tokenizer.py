"""Text <-> token ids for one model, its chat template, and streaming detokenization.

`Tokenizer` wraps a backend: a `tokenizers.Tokenizer` built from a Hugging Face `tokenizer.json` (see
hf_loader; ids equal those of transformers' AutoTokenizer), or a GGUF file's tokenizer as llama.cpp
runs it (see gguf_tokenizer; ids equal llama.cpp's).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as Backend

from shoal.model.chat_template import compile_chat_template, render_chat_template
from shoal.model.errors import ChatTemplateError, ModelLoadError
from shoal.model.gguf_backend import GGUFBackend
from shoal.model.gguf_loader import gguf_metadata, open_gguf
from shoal.model.gguf_tokenizer import gguf_tokenizer_spec

# What a Tokenizer wraps: both kinds answer the `tokenizers.Tokenizer` calls made here and in grammar.
TokenizerBackend = Backend | GGUFBackend

# Special tokens that end an assistant turn; one counts as EOS when the chat template writes it.
END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|END_OF_TURN_TOKEN|>")
# Harmony's (gpt-oss) turn enders: where a vocabulary has them, its <|end|> ends a message within the
# turn, not the turn (llama.cpp drops <|end|> from its end-of-generation tokens for the same reason).
HARMONY_TURN_ENDS = ("<|return|>", "<|call|>")
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")
# Stands in for a continued final message's content while the template renders (its last occurrence is taken).
_OPEN_END = "\x00shoal-open-end\x00"


class Tokenizer:
    """A model's tokenizer. Invariants: `eos_token_ids` is non-empty when the model names an EOS token, and
    holds every special end-of-turn token its chat template emits; templates are compiled once, at construction."""

    def __init__(
        self,
        backend: TokenizerBackend,
        *,
        special_tokens: Mapping[str, str | None],
        chat_template: str | Mapping[str, str] | None,
        extra_eos_ids: Iterable[int] = (),
    ):
        self._backend = backend
        self._special_tokens = {name: special_tokens.get(name) for name in _SPECIAL_TOKEN_NAMES}
        if chat_template is None:
            templates: dict[str, str] = {}
        elif isinstance(chat_template, str):
            templates = {"default": chat_template}
        else:
            templates = dict(chat_template)
        self._templates = templates
        self._compiled = {name: compile_chat_template(source) for name, source in templates.items()}
        self._extra_eos_ids = tuple(int(i) for i in extra_eos_ids)
        bos = self._special_tokens["bos_token"]
        self._bos_id = backend.token_to_id(bos) if bos is not None else None
        self._eos_ids = self._collect_eos_ids()

    @property
    def has_chat_template(self) -> bool:
        return "default" in self._templates

    def with_default_chat_template(self, source: str) -> Tokenizer:
        """This tokenizer with `source` as its default chat template (its other templates kept)."""
        return Tokenizer(
            self._backend,
            special_tokens=self._special_tokens,
            chat_template={**self._templates, "default": source},
            extra_eos_ids=self._extra_eos_ids,
        )

    def _collect_eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        eos = self._special_tokens["eos_token"]
        if eos is not None and (eos_id := self._backend.token_to_id(eos)) is not None:
            ids.append(eos_id)
        ids.extend(self._extra_eos_ids)
        specials = {t.content: i for i, t in self._backend.get_added_tokens_decoder().items() if t.special}
        template_text = "".join(self._templates.values())
        ids.extend(specials[t] for t in END_OF_TURN_TOKENS if t in specials and t in template_text)
        if all(t in specials for t in HARMONY_TURN_ENDS):  # however the file or template named it
            ids = [i for i in ids if i != specials.get("<|end|>")] + [specials[t] for t in HARMONY_TURN_ENDS]
        return tuple(dict.fromkeys(ids))

    @classmethod
    def from_gguf_metadata(cls, metadata: Mapping[str, Any], source: str | Path | None = None) -> Tokenizer:
        """From the `tokenizer.*` keys of a GGUF file (as returned by gguf_loader.gguf_metadata);
        `source`, the file, is named in errors."""
        spec = gguf_tokenizer_spec(dict(metadata), source)
        return cls(
            spec.backend,
            special_tokens=spec.special_tokens,
            chat_template=spec.chat_template,
            extra_eos_ids=spec.extra_eos_ids,
        )

    @classmethod
    def from_gguf(cls, path: str | Path) -> Tokenizer:
        """From a GGUF file (parses the whole header, about a second for a 50k vocabulary)."""
        return cls.from_gguf_metadata(gguf_metadata(open_gguf(path)), path)

    def to_json(self) -> str:
        """Lossless serialization, the inverse of `from_json` (used by the weight cache)."""
        backend = self._backend
        return json.dumps(
            {
                **({"gguf": backend.to_state()} if isinstance(backend, GGUFBackend) else {"backend": backend.to_str()}),
                "special_tokens": self._special_tokens,
                "chat_templates": self._templates,
                "extra_eos_ids": list(self._extra_eos_ids),
            }
        )

    @classmethod
    def from_json(cls, text: str) -> Tokenizer:
        try:
            state = json.loads(text)
            backend = GGUFBackend.from_state(state["gguf"]) if "gguf" in state else Backend.from_str(state["backend"])
        except Exception as exc:  # tokenizers reports parse errors as bare Exception
            raise ModelLoadError(f"corrupt serialized tokenizer: {exc}") from exc
        return cls(
            backend,
            special_tokens=state["special_tokens"],
            chat_template=state["chat_templates"] or None,
            extra_eos_ids=state["extra_eos_ids"],
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; special token strings in it map to their ids. add_special_tokens adds BOS/EOS
        as the model's tokenizer config asks (pass False for text rendered by `apply_chat_template`)."""
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_with_ends(self, text: str, add_special_tokens: bool = True) -> tuple[list[int], list[int]]:
        """`encode`, and where in `text` each token ends (character offsets, never decreasing; a token
        added ahead of the text ends at 0)."""
        if isinstance(self._backend, GGUFBackend):
            return self._backend.tokenize_with_ends(text, add_special=add_special_tokens)
        encoding = self._backend.encode(text, add_special_tokens=add_special_tokens)
        ends, furthest = [], 0
        for _, end in encoding.offsets:
            furthest = max(furthest, end)
            ends.append(furthest)
        return encoding.ids, ends

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        continue_final_message: bool = False,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for `messages` (OpenAI-style dicts), rendered by the model's own template.
        Uses the "tool_use" template when tools are given and the model has one, else "default".
        With continue_final_message the text ends with the last message's content as given, where
        the template would have closed that message (its end-of-turn and anything after it cut).
        `template_kwargs` are more variables for the template (`enable_thinking`, ...)."""
        name = "tool_use" if tools and "tool_use" in self._compiled else "default"
        if name not in self._compiled:
            raise ModelLoadError("this model has no chat template")
        final = dict(messages[-1]) if continue_final_message else None
        if final is not None:
            messages = [*messages[:-1], {**final, "content": _OPEN_END}]
        text = render_chat_template(
            self._compiled[name],
            messages,
            add_generation_prompt=add_generation_prompt,
            tools=tools,
            special_tokens=self._special_tokens,
            template_kwargs=template_kwargs,
        )
        if final is None:
            return text
        if _OPEN_END not in text:
            raise ChatTemplateError("the chat template does not render the final message's content")
        return text[: text.rindex(_OPEN_END)] + (final.get("content") or "")

    @property
    def backend(self) -> TokenizerBackend:
        """The underlying backend (shared, not a copy: do not mutate)."""
        return self._backend

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    def vocabulary(self) -> dict[str, int]:
        """Every token's id, added tokens included: two tokenizers with the same vocabulary give
        the same ids the same meaning."""
        return self._backend.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def chat_template(self) -> str | None:
        """The default chat template source, or None when the model has none."""
        return self._templates.get("default")

    def chat_template_for_tools(self) -> str | None:
        """The template source `apply_chat_template` uses when tools are given."""
        return self._templates.get("tool_use") or self.chat_template


class IncrementalDetokenizer:
    """Streams the text of generated ids one token at a time (vLLM's prefix/read offset technique).

    Text is released only when it no longer ends in an incomplete UTF-8 / byte-fallback sequence (U+FFFD).
    Invariant: the concatenation of all `add` results plus `flush()` equals the text the generated ids add
    to the prompt, i.e. `decode(ids)` when there is no prompt.
    """

    _CONTEXT = 5  # prompt tokens decoded along with the first generated ones, so leading spaces survive

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] | None = None, skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self._ids = list(prompt_ids or ())
        self._read_offset = len(self._ids)
        self._prefix_offset = max(self._read_offset - self._CONTEXT, 0)

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip)

    def add(self, token_id: int) -> str:
        """Appends one generated id; returns the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """Releases held-back text (incomplete characters decode to U+FFFD) at the end of generation."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        new_text = self._decode(self._prefix_offset)
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return new_text[len(prefix_text) :]
