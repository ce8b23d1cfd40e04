"""A GGUF vocabulary as llama.cpp reads it (`llama_vocab::impl::load` in src/llama-vocab.cpp).

Each token gets llama.cpp's attributes: from its `tokenizer.ggml.token_type`, then llama.cpp's fix-ups
by text (end-of-generation and fill-in-the-middle tokens become control tokens, gpt-oss' channel tokens
user-defined, and in a model named Phi-3 every special token strips the whitespace after it). The
attributes decide which tokens are cut out of text before merging (control and unknown tokens when
special tokens are parsed, user-defined ones always) and how each token is written back as text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from shoal.model.errors import ModelLoadError
from shoal.model.special_split import SpecialToken


class TokenAttr:
    """llama.cpp's `llama_token_attr` bits (plain ints: they are tested for every token)."""

    UNDEFINED = 0
    UNKNOWN = 1 << 0
    UNUSED = 1 << 1
    NORMAL = 1 << 2
    CONTROL = 1 << 3
    USER_DEFINED = 1 << 4
    BYTE = 1 << 5
    NORMALIZED = 1 << 6
    LSTRIP = 1 << 7
    RSTRIP = 1 << 8
    SINGLE_WORD = 1 << 9


# GGUF token type -> attribute (gguf.TokenType: NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6).
_TYPE_ATTR = {
    1: TokenAttr.NORMAL,
    2: TokenAttr.UNKNOWN,
    3: TokenAttr.CONTROL,
    4: TokenAttr.USER_DEFINED,
    5: TokenAttr.UNUSED,
    6: TokenAttr.BYTE,
}
_SPECIAL = TokenAttr.CONTROL | TokenAttr.USER_DEFINED | TokenAttr.UNKNOWN

# Texts llama.cpp treats as end of generation; each is made a control token.
_END_OF_GENERATION = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
)
# Fill-in-the-middle tokens by metadata key: when the file does not name one, the token found by its
# text becomes a control token (llama.cpp takes the first its hash map yields; here the lowest id).
_FILL_IN_THE_MIDDLE = {
    ("fim_pre_token_id", "prefix_token_id"): (
        "<|fim_prefix|>",
        "<fim-prefix>",
        "<fim_prefix>",
        "<｜fim▁begin｜>",
        "<PRE>",
        "▁<PRE>",
        "<|code_prefix|>",
        "<|prefix|>",
    ),
    ("fim_suf_token_id", "suffix_token_id"): (
        "<|fim_suffix|>",
        "<fim-suffix>",
        "<fim_suffix>",
        "<｜fim▁hole｜>",
        "<SUF>",
        "▁<SUF>",
        "<|code_suffix|>",
        "<|suffix|>",
    ),
    ("fim_mid_token_id", "middle_token_id"): (
        "<|fim_middle|>",
        "<fim-middle>",
        "<fim_middle>",
        "<｜fim▁end｜>",
        "<MID>",
        "▁<MID>",
        "<|code_middle|>",
        "<|middle|>",
    ),
    ("fim_pad_token_id",): ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    ("fim_rep_token_id",): ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    ("fim_sep_token_id",): ("<|file_sep|>",),
}
_ALWAYS_RENDERED = ("<|channel|>", "<|message|>", "<|start|>", "<|constrain|>")


def token_attrs(meta: dict[str, Any], tokens: Sequence[str]) -> list[int]:
    """Each token's attributes as llama.cpp sets them: from `tokenizer.ggml.token_type` (all normal
    when the file has none), then its fix-ups by text and, for a model named Phi-3, rstrip."""
    n = len(tokens)
    types = meta.get("tokenizer.ggml.token_type")
    if types is not None and len(types) < n:
        raise ModelLoadError(f"GGUF tokenizer has {n} tokens but {len(types)} token types")
    attrs = (
        [TokenAttr.NORMAL] * n if types is None else [_TYPE_ATTR.get(int(t), TokenAttr.UNDEFINED) for t in types[:n]]
    )
    ids = {text: i for i, text in enumerate(tokens)}
    for keys, texts in _FILL_IN_THE_MIDDLE.items():
        if not any(f"tokenizer.ggml.{key}" in meta for key in keys):
            found = sorted(ids[t] for t in texts if t in ids)
            if found:
                attrs[found[0]] |= TokenAttr.CONTROL
    for i, attr in enumerate(attrs):
        if attr & TokenAttr.CONTROL and "unused" in tokens[i]:
            attrs[i] |= TokenAttr.UNUSED
    for text in _END_OF_GENERATION:
        if text in ids:
            attrs[ids[text]] |= TokenAttr.CONTROL
    for text in _ALWAYS_RENDERED:
        if text in ids:
            attrs[ids[text]] = TokenAttr.USER_DEFINED
    # gpt-oss and Solar Open: "<|end|>" ends a message, not the generation.
    call = "<|call|>" in ids or "<|calls|>" in ids
    if "<|end|>" in ids and call and ("<|return|>" in ids or "<|flush|>" in ids):
        attrs[ids["<|end|>"]] = TokenAttr.USER_DEFINED
    # Gemma 4: "</s>" is an ordinary token.
    if "</s>" in ids and "<|tool_response>" in ids:
        attrs[ids["</s>"]] = TokenAttr.NORMAL
    name = str(meta.get("general.name", "")).lower()
    if "phi-3" in name or "phi3" in name:
        for i, attr in enumerate(attrs):
            if attr & _SPECIAL:
                attrs[i] |= TokenAttr.RSTRIP
        if "</s>" in ids:
            attrs[ids["</s>"]] |= TokenAttr.RSTRIP
        for text in ("<unk>", "<s>", "<|endoftext|>"):
            if text in ids:
                attrs[ids[text]] &= ~TokenAttr.RSTRIP
    return attrs


def special_tokens(tokens: Sequence[str], attrs: Sequence[int], parse_special: bool = True) -> list[SpecialToken]:
    """The tokens cut out of text before merging, in the order llama.cpp tries them: longest text
    first (equal lengths by id). Control and unknown tokens only when `parse_special`."""
    kinds = _SPECIAL if parse_special else TokenAttr.USER_DEFINED
    chosen = [i for i, attr in enumerate(attrs) if attr & kinds]
    chosen.sort(key=lambda i: -len(tokens[i].encode("utf-8")))
    return [
        SpecialToken(tokens[i], i, lstrip=bool(attrs[i] & TokenAttr.LSTRIP), rstrip=bool(attrs[i] & TokenAttr.RSTRIP))
        for i in chosen
    ]


@dataclass(frozen=True)
class LlamaVocab:
    """A GGUF vocabulary: its tokenizer model ("llama": SentencePiece, "gpt2": byte-level BPE), tokens,
    scores (SentencePiece only) and attributes, its special ids, and how text is wrapped: BOS/EOS
    added, a space put before text that starts the input or follows a special token (SentencePiece),
    and one space taken off the front when decoding."""

    model: str
    tokens: tuple[str, ...]
    scores: tuple[float, ...]
    attrs: tuple[int, ...]
    bos_id: int | None
    eos_id: int | None
    unk_id: int | None
    pad_id: int | None
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool

    @classmethod
    def from_gguf_metadata(cls, meta: dict[str, Any], add_bos: bool = True, has_bos: bool = True) -> LlamaVocab:
        """From `tokenizer.ggml.*` metadata (as returned by `gguf_metadata`) of a "llama" or "gpt2"
        tokenizer. `add_bos` is what a "gpt2" file adds when it does not say (its pre-tokenizer's
        default); `has_bos` False drops its BOS id, as llama.cpp does for ChatGLM."""
        model = meta.get("tokenizer.ggml.model")
        if model not in ("llama", "gpt2"):
            raise ModelLoadError(f"GGUF tokenizer model {model!r} is not SentencePiece or byte-level BPE")
        spm = model == "llama"
        tokens = tuple(text or f"[EMPTY_{i}]" for i, text in enumerate(meta.get("tokenizer.ggml.tokens") or []))
        n = len(tokens)
        scores: list[float] = []
        if spm:
            scores = [float(s) for s in meta.get("tokenizer.ggml.scores") or [0.0] * n]
            if len(scores) < n:
                raise ModelLoadError(f"GGUF tokenizer has {n} tokens but {len(scores)} scores")

        def special_id(key: str, default: int | None) -> int | None:
            value = meta.get(f"tokenizer.ggml.{key}")
            if value is not None and 0 <= int(value) < n:
                return int(value)
            return default if default is not None and default < n else None

        # llama.cpp's defaults where the file names no id: SentencePiece's usual 1, 2 and 0; none for
        # byte-level BPE (where llama.cpp would take id 11, whatever token that is).
        bos_id = special_id("bos_token_id", 1 if spm else None)
        return cls(
            model=model,
            tokens=tokens,
            scores=tuple(scores[:n]),
            attrs=tuple(token_attrs(meta, tokens)),
            bos_id=bos_id if spm or has_bos else None,
            eos_id=special_id("eos_token_id", 2 if spm else None),
            unk_id=special_id("unknown_token_id", 0 if spm else None),
            pad_id=special_id("padding_token_id", None),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True if spm else add_bos)),
            add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", spm)),
        )

    def special_tokens(self, parse_special: bool = True) -> list[SpecialToken]:
        return special_tokens(self.tokens, self.attrs, parse_special)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> LlamaVocab:
        return cls(**{**state, **{key: tuple(state[key]) for key in ("tokens", "scores", "attrs")}})
