"""Builds a `tokenizers.Tokenizer` from GGUF `tokenizer.ggml.*` metadata.

Mirrors transformers' GGUF tokenizer conversion (integrations/gguf/gguf_tokenizer_mapping.py), so that
ids equal `AutoTokenizer.from_pretrained(dir, gguf_file=...)`:
- "gpt2": byte-level BPE with the file's merges; tokens outside the byte alphabet are respelled in it;
  the split regex comes from `tokenizer.ggml.pre` when known, else GPT-2's default.
- "llama": SentencePiece-style BPE with byte fallback; merges from the file or derived from the scores.
Control tokens (type 3) become special added tokens, user-defined tokens (type 4) plain added tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from shoal.model.errors import ModelLoadError

_CONTROL, _USER_DEFINED = 3, 4
# transformers builds these architectures' SentencePiece tokenizers with model-specific respelling.
_RESPELLED_SENTENCEPIECE_ARCHITECTURES = ("gemma", "gemma2", "gemma3", "gemma4", "phi3")

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# `tokenizer.ggml.pre` -> split regex; names not listed (e.g. SmolLM2's "smollm") keep GPT-2's regex.
PRE_TOKENIZER_SPLITS = {
    **dict.fromkeys(
        (
            "llama3",
            "llama-v3",
            "llama-bpe",
            "falcon3",
            "falcon-h1",
            "pixtral",
            "midm-2.0",
            "lfm2",
            "jina-v5-nano",
            "dbrx",
            "smaug-bpe",
        ),
        _LLAMA3_SPLIT,
    ),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2_SPLIT),
    "qwen35": _QWEN35_SPLIT,
    "tekken": _TEKKEN_SPLIT,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O_SPLIT),
}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table used by byte-level BPE vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a token into two tokens, best score first.

    Same order as transformers' `generate_merges` (score, then left/right lengths, descending).
    """
    vocab = {token: index for index, token in enumerate(tokens)}
    merges: list[tuple[str, str, float]] = []
    for token, score in dict(zip(tokens, scores)).items():
        local = [
            (token[:i], token[i:], score) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab
        ]
        merges.extend(sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]])))
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


@dataclass(frozen=True)
class GGUFTokenizerSpec:
    """What a GGUF file says about its tokenizer, beyond the backend itself."""

    backend: Backend
    special_tokens: dict[str, str | None]
    chat_template: str | None
    extra_eos_ids: tuple[int, ...]


def _byte_level_backend(tokens: list[str], merges: list[str]) -> tuple[Backend, tuple[str, ...]]:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab = {
        token if set(token) <= alphabet else "".join(spelling[b] for b in token.encode("utf-8")): index
        for index, token in enumerate(tokens)
    }
    model = BPE(
        vocab=vocab,
        merges=[tuple(m.split(" ")) for m in merges],
        dropout=None,
        continuing_subword_prefix="",
        end_of_word_suffix="",
        fuse_unk=False,
    )
    backend = Backend(model)
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    return backend, ("<|endoftext|>",)


def _sentencepiece_backend(
    tokens: list[str], merges: list[str] | None, scores: list[float] | None
) -> tuple[Backend, tuple[str, ...]]:
    if merges is not None:
        pairs = [tuple(m.split(" ")) for m in merges]
    elif scores is not None:
        pairs = merges_from_scores(tokens, scores)
    else:
        raise ModelLoadError("GGUF SentencePiece tokenizer has neither merges nor scores")
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = Backend(BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("\u2581", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return backend, ("<unk>", "<s>", "</s>")


def _post_processor(
    bos: str | None, eos: str | None, add_bos: bool, add_eos: bool, vocab: dict[str, int]
) -> processors.TemplateProcessing:
    """transformers' `update_post_processor`: optional BOS before and EOS after each sequence."""
    add_bos, add_eos = add_bos and bos is not None, add_eos and eos is not None
    single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
    pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
    specials = ([(bos, vocab[bos])] if add_bos else []) + ([(eos, vocab[eos])] if add_eos else [])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def gguf_tokenizer_spec(meta: dict[str, Any]) -> GGUFTokenizerSpec:
    """The tokenizer described by a GGUF file's metadata (as returned by `gguf_metadata`)."""
    kind = meta.get("tokenizer.ggml.model")
    tokens: list[str] = meta.get("tokenizer.ggml.tokens") or []
    if not tokens:
        raise ModelLoadError("GGUF file has no tokenizer.ggml.tokens")
    token_types: list[int] = meta.get("tokenizer.ggml.token_type") or []
    if kind == "gpt2":
        backend, class_defaults = _byte_level_backend(tokens, meta.get("tokenizer.ggml.merges") or [])
        # A "control" token spelled outside the byte alphabet is a llama.cpp mislabel; transformers skips it.
        alphabet: set[str] | None = set(bytes_to_unicode().values())
    elif kind == "llama":
        arch = meta.get("general.architecture")
        if arch in _RESPELLED_SENTENCEPIECE_ARCHITECTURES:
            raise ModelLoadError(f"the SentencePiece tokenizer variant of {arch!r} is not supported")
        backend, class_defaults = _sentencepiece_backend(
            tokens, meta.get("tokenizer.ggml.merges"), meta.get("tokenizer.ggml.scores")
        )
        alphabet = None
    else:
        raise ModelLoadError(f"GGUF tokenizer model {kind!r} is not supported (supported: gpt2, llama)")

    vocab = backend.get_vocab()
    # transformers' tokenizer classes register their default special tokens first (when in the vocabulary).
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in class_defaults if t in vocab])
    backend.add_special_tokens(
        [
            AddedToken(token, normalized=False, special=True)
            for token, kind_ in zip(tokens, token_types)
            if kind_ == _CONTROL and (alphabet is None or set(token) <= alphabet)
        ]
    )
    vocab = backend.get_vocab()
    backend.add_tokens(
        [
            AddedToken(token, normalized=False, special=False)
            for token, kind_ in zip(tokens, token_types)
            if kind_ == _USER_DEFINED and token in vocab
        ]
    )

    def token_of(key: str) -> str | None:
        index = meta.get(f"tokenizer.ggml.{key}")
        return tokens[index] if index is not None and 0 <= index < len(tokens) else None

    special_tokens = {
        "bos_token": token_of("bos_token_id"),
        "eos_token": token_of("eos_token_id"),
        "unk_token": token_of("unknown_token_id"),
        "pad_token": token_of("padding_token_id"),
    }
    backend.add_special_tokens(
        [AddedToken(t, special=True, normalized=False) for t in dict.fromkeys(special_tokens.values()) if t is not None]
    )

    split = PRE_TOKENIZER_SPLITS.get(meta.get("tokenizer.ggml.pre", ""))
    if split is not None:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))
    backend.post_processor = _post_processor(
        special_tokens["bos_token"], special_tokens["eos_token"], add_bos, add_eos, backend.get_vocab()
    )
    extra_eos = tuple(meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta)
    return GGUFTokenizerSpec(
        backend=backend,
        special_tokens=special_tokens,
        chat_template=meta.get("tokenizer.chat_template"),
        extra_eos_ids=extra_eos,
    )
