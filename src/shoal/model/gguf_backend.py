"""A GGUF vocabulary's tokenizer as llama.cpp runs it, with the methods of `tokenizers.Tokenizer` that
`shoal.model.tokenizer.Tokenizer` and the grammar compiler call (encode, decode, token lookups, added
tokens, `to_str`).

Encoding (`llama_vocab::impl::tokenize`, special tokens parsed): control, unknown and user-defined
tokens are cut out of the text (special_split); each stretch of text left is then tokenized alone.
SentencePiece: the stretch gets a leading space when the vocabulary adds one and the stretch starts
the input or follows a special token, spaces become U+2581, and it is merged by score (spm_encoder).
Byte-level BPE: a `tokenizers` BPE model with llama.cpp's pre-tokenizer (bpe_pretokenizers). BOS and
EOS are added as the vocabulary says.

Decoding (`llama_vocab::impl::detokenize`): a normal token is its text (SentencePiece: U+2581 read as a
space; byte-level BPE: each character read as the byte it stands for), a byte token `<0xXX>` its
byte, a user-defined token its text, a control or unknown token its text only when special tokens
are shown; the first token (after a dropped BOS) loses one leading space when the vocabulary adds a
space prefix, so that text encoded without special tokens, or with BOS and decoded skipping special
tokens, comes back as it was; the bytes are read as UTF-8, an incomplete or invalid sequence as U+FFFD.
llama.cpp's optional clean-up of spaces before punctuation is not done: it does not round-trip.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from tokenizers import AddedToken, decoders, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.models import BPE

from shoal.model.llama_vocab import LlamaVocab, TokenAttr
from shoal.model.special_split import split_special
from shoal.model.spm_encoder import SpmEncoder

_SPACE = "\u2581"
_HIDDEN = TokenAttr.CONTROL | TokenAttr.UNKNOWN  # written out only when special tokens are shown
_VERBATIM = _HIDDEN | TokenAttr.USER_DEFINED


@dataclass(frozen=True)
class Encoding:
    """The result of `GGUFBackend.encode` (the `.ids` of a `tokenizers.Encoding`)."""

    ids: list[int]


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


_BYTE_OF = {char: byte for byte, char in bytes_to_unicode().items()}
_AS_LATIN1 = {ord(char): chr(byte) for char, byte in _BYTE_OF.items()}  # str.translate: each char to its byte
_STANDS_FOR_A_BYTE = dict.fromkeys(map(ord, _BYTE_OF))  # str.translate: deletes the chars that stand for a byte


def _byte_level_bytes(text: str) -> bytes:
    """llama.cpp's `llama_decode_text`: each character as the byte it stands for."""
    if not text.translate(_STANDS_FOR_A_BYTE):  # every character stands for a byte (a vocabulary's text does)
        return text.translate(_AS_LATIN1).encode("latin-1")
    out = bytearray()
    for char in text:
        byte = _BYTE_OF.get(char)
        if byte is None:
            out += f"[UNK_BYTE_0x{char.encode().hex()}{text}]".encode()
        else:
            out.append(byte)
    return bytes(out)


def _piece(vocab: LlamaVocab, token: int) -> bytes:
    """llama.cpp's `token_to_piece` for one token, special tokens shown (hidden, a control or unknown
    token's piece is empty)."""
    text, attr = vocab.tokens[token], vocab.attrs[token]
    if attr & _VERBATIM:
        return text.encode()
    if attr & TokenAttr.NORMAL:
        return text.replace(_SPACE, " ").encode() if vocab.model == "llama" else _byte_level_bytes(text)
    if attr & TokenAttr.BYTE:
        try:
            return bytes([int(text[3:5], 16)])
        except ValueError:
            return b"\x00"
    return b""  # unused and undefined tokens have no text


def _merges_from_scores(vocab: LlamaVocab) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a normal or user-defined token
    into two tokens, best score first (then longer left, longer right parts, as transformers orders
    them)."""
    ids = {text: i for i, text in enumerate(vocab.tokens)}
    mergeable = TokenAttr.NORMAL | TokenAttr.USER_DEFINED
    merges: list[tuple[float, int, int, int, int, str, str]] = []
    for text, score, attr in zip(vocab.tokens, vocab.scores, vocab.attrs):
        if not attr & mergeable:
            continue
        for i in range(1, len(text)):
            left, right = text[:i], text[i:]
            if left in ids and right in ids:
                merges.append((-score, -len(left), -len(right), ids[left], ids[right], left, right))
    merges.sort()
    return [(left, right) for *_, left, right in merges]


class GGUFBackend:
    """The tokenizer of a GGUF vocabulary, as llama.cpp runs it. `bpe` is the byte-level BPE model and
    pre-tokenizer that tokenizes the text between special tokens ("gpt2" vocabularies only). Immutable."""

    def __init__(self, vocab: LlamaVocab, bpe: HFTokenizer | None = None):
        if (vocab.model == "gpt2") != (bpe is not None):
            raise ValueError("a byte-level BPE vocabulary needs its BPE tokenizer, and only it")
        self.vocab = vocab
        self._bpe = bpe
        self._ids = {text: i for i, text in enumerate(vocab.tokens)}
        self._encoder: SpmEncoder | None = None
        if vocab.model == "llama":
            byte_ids = [self._ids.get(f"<0x{b:02X}>", self._ids.get(chr(b)) if b < 0x80 else None) for b in range(256)]
            # llama.cpp fails on a byte it has no token for; the unknown token stands in for it here.
            self._encoder = SpmEncoder(self._ids, vocab.scores, [vocab.unk_id if i is None else i for i in byte_ids])
        self._specials = vocab.special_tokens(parse_special=True)
        self._special_pieces = [_piece(vocab, i) for i in range(len(vocab.tokens))]
        self._pieces = [b"" if attr & _HIDDEN else piece for piece, attr in zip(self._special_pieces, vocab.attrs)]

    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        """`llama_tokenize(text, add_special, parse_special=true)`."""
        return self._tokenize(text, add_special, None)

    def tokenize_with_ends(self, text: str, add_special: bool = True) -> tuple[list[int], list[int]]:
        """`tokenize`, and where in `text` each token ends (a character offset; an added BOS ends at 0,
        an added EOS at the text's end). Ends never decrease. Within a stretch of SentencePiece text
        the ends count the characters of each token's piece (a byte token counts one character where
        it starts one), less the leading space the vocabulary adds."""
        ends: list[int] = []
        return self._tokenize(text, add_special, ends), ends

    def _tokenize(self, text: str, add_special: bool, ends: list[int] | None) -> list[int]:
        """The ids of `text`; where `ends` is given, each id's end offset is appended to it."""
        vocab = self.vocab
        ids: list[int] = []
        if add_special and vocab.add_bos and vocab.bos_id is not None:
            ids.append(vocab.bos_id)
            if ends is not None:
                ends.append(0)
        after_special = True
        cursor = 0
        for fragment in split_special(text, self._specials):
            if isinstance(fragment, int):
                ids.append(fragment)
                after_special = True
                if ends is not None:
                    found = text.find(vocab.tokens[fragment], cursor)
                    cursor = cursor if found < 0 else found + len(vocab.tokens[fragment])
                    ends.append(cursor)
                continue
            if self._encoder is not None:
                added = 1 if vocab.add_space_prefix and after_special else 0
                pieces = self._encoder.encode((" " * added + fragment).replace(" ", _SPACE))
                after_special = False
            else:
                encoding = self._bpe.encode(fragment, add_special_tokens=False)
                pieces = encoding.ids
            ids.extend(pieces)
            if ends is not None:
                start = max(text.find(fragment, cursor), cursor)
                if self._encoder is not None:
                    position = start - added
                    for token in pieces:
                        position += self._piece_chars(token)
                        ends.append(min(max(position, start), start + len(fragment)))
                else:
                    ends.extend(start + end for _, end in encoding.offsets)
                cursor = start + len(fragment)
        if add_special and vocab.add_eos and vocab.eos_id is not None:
            ids.append(vocab.eos_id)
            if ends is not None:
                ends.append(len(text))
        return ids

    def _piece_chars(self, token: int) -> int:
        """How many characters of the text a SentencePiece token stands for (a byte token: one where
        it starts a character, none where it continues one)."""
        piece = self._pieces[token]
        if self.vocab.attrs[token] & TokenAttr.BYTE:
            return 0 if piece and piece[0] & 0xC0 == 0x80 else 1
        return len(piece.decode("utf-8", errors="replace"))

    def detokenize(self, ids: Sequence[int], remove_special: bool, unparse_special: bool) -> str:
        """`llama_detokenize(ids, remove_special, unparse_special)` without its space clean-up, and
        with the space prefix taken off after a dropped BOS too (llama.cpp keeps it there, so its
        text for `tokenize(text)` would start with a space); ids outside the vocabulary add nothing."""
        vocab = self.vocab
        ids = list(ids)
        remove_space = vocab.add_space_prefix
        if remove_special and vocab.add_bos and ids and ids[0] == vocab.bos_id:
            ids = ids[1:]
        if remove_special and vocab.add_eos and ids and ids[-1] == vocab.eos_id:
            ids = ids[:-1]
        table = self._special_pieces if unparse_special else self._pieces
        pieces = [table[i] if 0 <= i < len(table) else b"" for i in ids]
        if remove_space and pieces and pieces[0].startswith(b" "):
            pieces[0] = pieces[0][1:]
        return b"".join(pieces).decode("utf-8", "replace")

    def token_bytes(self, token: int, special: bool = True) -> bytes:
        """One token's bytes (`llama_token_to_piece`): b"" for a hidden special token or an unused one."""
        table = self._special_pieces if special else self._pieces
        return table[token] if 0 <= token < len(table) else b""

    # The `tokenizers.Tokenizer` methods shoal calls.

    def encode(self, text: str, add_special_tokens: bool = True) -> Encoding:
        return Encoding(self.tokenize(text, add_special=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Skipping special tokens drops a leading BOS (and trailing EOS, where the vocabulary adds
        one) and hides control tokens; otherwise every token is written out."""
        return self.detokenize(ids, remove_special=skip_special_tokens, unparse_special=not skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._ids.get(token)

    def id_to_token(self, id: int) -> str | None:
        return self.vocab.tokens[id] if 0 <= id < len(self.vocab.tokens) else None

    def get_vocab(self, with_added_tokens: bool = True) -> dict[str, int]:
        return dict(self._ids)

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return len(self.vocab.tokens)

    def get_added_tokens_decoder(self) -> dict[int, AddedToken]:
        """Control and unknown tokens (special) and user-defined tokens (not special)."""
        return {
            i: AddedToken(self.vocab.tokens[i], special=bool(attr & _HIDDEN), normalized=False)
            for i, attr in enumerate(self.vocab.attrs)
            if attr & _VERBATIM
        }

    def to_str(self) -> str:
        """A `tokenizer.json` with the same tokens, special tokens and decoder, for libraries that
        read token bytes from one and tokenize text a grammar forces with it (llguidance). For a
        SentencePiece vocabulary its BPE merges come from the scores (as transformers converts
        one): close to, not always equal to, llama.cpp's merging. Built on first use (seconds for a
        256k vocabulary)."""
        return self._hf_json

    @cached_property
    def _hf_json(self) -> str:
        vocab = self.vocab
        if self._bpe is not None:
            hf = HFTokenizer.from_str(self._bpe.to_str())
            hf.decoder = decoders.ByteLevel()
        else:
            unk = vocab.tokens[vocab.unk_id] if vocab.unk_id is not None else None
            merges = _merges_from_scores(vocab)
            hf = HFTokenizer(
                BPE(vocab=dict(self._ids), merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True)
            )
            hf.pre_tokenizer = pre_tokenizers.Metaspace(
                replacement=_SPACE, prepend_scheme="first" if vocab.add_space_prefix else "never", split=False
            )
            steps = [decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
            hf.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)] if vocab.add_space_prefix else steps)
        added = self.get_added_tokens_decoder().values()
        # Unused tokens have no text: as special tokens, no grammar can take them for their spelling.
        unused = [t for t, a in zip(vocab.tokens, vocab.attrs) if a & TokenAttr.UNUSED and not a & _VERBATIM]
        specials = [t.content for t in added if t.special] + unused
        hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
        hf.add_tokens([AddedToken(t.content, special=False, normalized=False) for t in added if not t.special])
        return hf.to_str()

    # Serialization (Tokenizer.to_json / from_json).

    def to_state(self) -> dict[str, Any]:
        return {"vocab": self.vocab.to_dict(), "bpe": self._bpe.to_str() if self._bpe is not None else None}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> GGUFBackend:
        bpe = HFTokenizer.from_str(state["bpe"]) if state["bpe"] is not None else None
        return cls(LlamaVocab.from_dict(state["vocab"]), bpe)

    def __repr__(self) -> str:
        return f"GGUFBackend({self.vocab.model!r}, {len(self.vocab.tokens)} tokens)"
