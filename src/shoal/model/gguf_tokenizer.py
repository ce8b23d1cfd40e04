"""The tokenizer a GGUF file describes in its `tokenizer.ggml.*` metadata, giving llama.cpp's token ids.

- "llama" (SentencePiece): llama.cpp's own algorithm (gguf_backend, spm_encoder): merges by score,
  byte fallback, U+2581 for spaces, a space prefix where the file asks for one (not for Gemma).
- "gpt2" (byte-level BPE): a `tokenizers.Tokenizer` with the file's merges and llama.cpp's
  pre-tokenizer for `tokenizer.ggml.pre` (bpe_pretokenizers). Control, unknown and user-defined
  tokens keep the text the file gives them and are matched in text before BPE (control and unknown
  ones as special tokens), as llama.cpp does.

Token attributes follow llama.cpp's reading of the file, fix-ups by text included (llama_vocab).
Other tokenizer models (bert, t5, rwkv, ...) are refused.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenizers import Regex, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from shoal.model.bpe_pretokenizers import PRE_TOKENIZERS, pre_tokenizer_regexes
from shoal.model.errors import ModelLoadError
from shoal.model.gguf_backend import GGUFBackend
from shoal.model.llama_vocab import LlamaVocab

# `tokenizer.ggml.model` values read here: SentencePiece ("llama") and byte-level BPE ("gpt2").
SUPPORTED_MODELS = ("llama", "gpt2")


@dataclass(frozen=True)
class GGUFTokenizerSpec:
    """What a GGUF file says about its tokenizer, beyond the backend itself."""

    backend: GGUFBackend
    special_tokens: dict[str, str | None]
    chat_template: str | None
    extra_eos_ids: tuple[int, ...]


def gguf_tokenizer_spec(meta: dict[str, Any], source: object = None) -> GGUFTokenizerSpec:
    """The tokenizer described by a GGUF file's metadata (as returned by `gguf_metadata`); `source`
    (the file) is named in errors."""
    where = f"{source}: " if source is not None else ""
    kind = meta.get("tokenizer.ggml.model")
    if kind not in SUPPORTED_MODELS:
        raise ModelLoadError(
            f"{where}GGUF tokenizer model {kind!r} is not supported (supported: {', '.join(SUPPORTED_MODELS)})"
        )
    if not meta.get("tokenizer.ggml.tokens"):
        raise ModelLoadError(f"{where}GGUF file has no tokenizer.ggml.tokens")
    if kind == "llama":
        return _sentencepiece_spec(meta)
    return _byte_level_spec(meta, where)


def _sentencepiece_spec(meta: dict[str, Any]) -> GGUFTokenizerSpec:
    vocab = LlamaVocab.from_gguf_metadata(meta)
    return _spec(meta, vocab, GGUFBackend(vocab))


def _byte_level_spec(meta: dict[str, Any], where: str) -> GGUFTokenizerSpec:
    pre_name = meta.get("tokenizer.ggml.pre") or "default"
    pre = PRE_TOKENIZERS.get(pre_name)
    if pre is None:
        raise ModelLoadError(f"{where}GGUF pre-tokenizer {pre_name!r} (tokenizer.ggml.pre) is not supported")
    vocab = LlamaVocab.from_gguf_metadata(meta, add_bos=pre.add_bos, has_bos=pre.has_bos)
    ids = {token: index for index, token in enumerate(vocab.tokens)}
    # A merge whose result is no token can only leave bytes in llama.cpp: it is left out here.
    merges = [pair for pair in map(_merge_pair, meta.get("tokenizer.ggml.merges") or []) if "".join(pair) in ids]
    # The text between special tokens only: those are cut out before (GGUFBackend).
    bpe = Backend(
        BPE(
            vocab=ids,
            merges=merges,
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            ignore_merges=pre.ignore_merges,
        )
    )
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            *(pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in pre_tokenizer_regexes(pre)),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    return _spec(meta, vocab, GGUFBackend(vocab, bpe))


def _spec(meta: dict[str, Any], vocab: LlamaVocab, backend: GGUFBackend) -> GGUFTokenizerSpec:
    def text_of(index: int | None) -> str | None:
        return vocab.tokens[index] if index is not None else None

    return GGUFTokenizerSpec(
        backend=backend,
        special_tokens={
            "bos_token": text_of(vocab.bos_id),
            "eos_token": text_of(vocab.eos_id),
            "unk_token": text_of(vocab.unk_id),
            "pad_token": text_of(vocab.pad_id),
        },
        chat_template=meta.get("tokenizer.chat_template"),
        extra_eos_ids=tuple(
            meta[k] for k in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id") if k in meta
        ),
    )


def _merge_pair(merge: str) -> tuple[str, str]:
    """A `tokenizer.ggml.merges` entry split as llama.cpp splits it: at the first space after the start."""
    at = merge.find(" ", 1)
    return (merge[:at], merge[at + 1 :]) if at >= 0 else ("", "")  # ("", "") is no token
