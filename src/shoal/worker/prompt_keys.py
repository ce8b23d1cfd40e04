"""Which of a prompt's token blocks each of the router's prefix keys needs (shoal.protocol.prefix_keys).

The router names a request's prefixes by its canonical text, cut into blocks of characters; the
engine caches token blocks of the prompt its chat template renders. Each message's text is found
again in the rendered prompt, in order, so a canonical offset inside one maps to a rendered offset;
one between messages maps to the end of the last text found, and one past a text that is not found
(a template that rewrites it) to where the last one found ended. A key ending at rendered offset E
needs the full token blocks of the tokens that end by E, less the last one (whose text may merge
with what follows in another request): what any request with that key's prefix also has.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

from shoal.protocol.prefix_keys import CanonicalPrompt, block_ends


def rendered_offsets(canonical: CanonicalPrompt, rendered: str, ends: Sequence[int]) -> list[int]:
    """For each canonical offset in `ends` (ascending), the rendered offset the text up to it reaches."""
    anchors = []  # (canonical start, rendered start, length) of each message text found
    cursor = 0
    for start, text in canonical.spans:
        found = rendered.find(text, cursor)
        if found < 0:
            break
        anchors.append((start, found, len(text)))
        cursor = found + len(text)
    mapped, reached, next_anchor = [], 0, 0
    for end in ends:
        while next_anchor < len(anchors) and anchors[next_anchor][0] <= end:
            next_anchor += 1
        if next_anchor:
            start, found, length = anchors[next_anchor - 1]
            reached = found + min(end - start, length)
        mapped.append(reached)
    return mapped


def key_blocks(
    canonical: CanonicalPrompt,
    rendered: str,
    token_ends: Sequence[int],
    block_size: int,
    cache_key: str | None = None,
) -> list[int]:
    """For each prefix key of the canonical prompt, how many of the prompt's full token blocks a
    request with that key's prefix shares with this one (0: none sure)."""
    full_blocks = len(token_ends) // block_size
    offsets = rendered_offsets(canonical, rendered, block_ends(len(canonical.text), cache_key))
    return [min(max(bisect_right(token_ends, offset) - 1, 0) // block_size, full_blocks) for offset in offsets]


def prompt_keys(
    keys: Sequence[bytes],
    canonical: CanonicalPrompt,
    rendered: str,
    token_ends: Sequence[int],
    block_size: int,
    cache_key: str | None = None,
) -> tuple[list[bytes], list[int]]:
    """Of the router's prefix keys for the request (`router_keys`), those that need at least one
    token block, and how many each needs."""
    blocks = key_blocks(canonical, rendered, token_ends, block_size, cache_key)
    needed = [(key, count) for key, count in zip(keys, blocks) if count]
    return [key for key, _ in needed], [count for _, count in needed]
