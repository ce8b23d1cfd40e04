"""Text split around special tokens before it is tokenized, as llama.cpp does it
(`tokenizer_st_partition` in src/llama-vocab.cpp).

Special tokens are taken one at a time, longest text first; each one is cut out of every stretch of
text not yet cut, at every occurrence, left to right. A token marked lstrip eats the whitespace
before it, one marked rstrip the whitespace after it (C `isspace`: space, \\t, \\n, \\v, \\f, \\r).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

_C_SPACE = " \t\n\v\f\r"


@dataclass(frozen=True)
class SpecialToken:
    """A token cut out of text before tokenization."""

    text: str
    id: int
    lstrip: bool = False
    rstrip: bool = False


def split_special(text: str, specials: Sequence[SpecialToken]) -> list[str | int]:
    """`text` as a list of stretches of text (non-empty str) and special token ids (int), in order.
    `specials` must be in the order they are tried (longest text first)."""
    fragments: list[str | int] = [text] if text else []
    # A token can only occur where its first two characters do (vocabularies hold thousands of
    # control tokens, and most texts none of them).
    starts = {text[i : i + 2] for i in range(len(text))} | set(text)
    for special in specials:
        if special.text[:2] not in starts or special.text not in text:  # nor then in any stretch of it
            continue
        split: list[str | int] = []
        for fragment in fragments:
            if isinstance(fragment, int) or special.text not in fragment:
                split.append(fragment)
                continue
            rest = fragment
            while (at := rest.find(special.text)) >= 0:
                left = rest[:at].rstrip(_C_SPACE) if special.lstrip else rest[:at]
                if left:
                    split.append(left)
                split.append(special.id)
                rest = rest[at + len(special.text) :]
                if special.rstrip:
                    rest = rest.lstrip(_C_SPACE)
            if rest:
                split.append(rest)
        fragments = split
    return fragments
