"""The router's approximate picture of each worker's prefix cache, without a tokenizer.

A prompt is cut into fixed-size character blocks, each identified by a chained hash (hash of the
previous block's hash and its characters), so equal hashes mean equal whole prefixes, as in the
workers' own block manager. For each worker the index keeps the blocks the router has sent it, least
recently used first out, up to a capacity matching the worker's KV cache and KV tier. Blocks sent
longer ago than its paged cache holds are taken to have gone down to its tier (`in_tier`). It is
an estimate: workers evict on their own schedule, and the index learns nothing from them.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

BLOCK_CHARS = 32


def prefix_blocks(text: str, block_chars: int = BLOCK_CHARS) -> tuple[bytes, ...]:
    """Chained hashes of the full blocks of `text` (a trailing partial block is not cached anyway)."""
    blocks, parent = [], b""
    for start in range(0, len(text) - block_chars + 1, block_chars):
        parent = hashlib.blake2b(parent + text[start : start + block_chars].encode(), digest_size=12).digest()
        blocks.append(parent)
    return tuple(blocks)


def chat_prompt_text(messages: list) -> str:
    """A canonical text for chat messages: a conversation's next turn extends the previous one's text."""
    parts = []
    for message in messages:
        if isinstance(message, dict):
            content = message.get("content")
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
            parts.append(f"<|{message.get('role')}|>{content or ''}\n")
    return "".join(parts)


class PrefixIndex:
    """Invariant: each worker's entry holds at most its capacity in blocks, most recently used last,
    each with the worker's record count when it was last recorded (its clock)."""

    def __init__(self):
        self._blocks: dict[str, OrderedDict[bytes, int]] = {}
        self._clock: dict[str, int] = {}

    def matched_blocks(self, blocks: tuple[bytes, ...], worker_ids: list[str]) -> dict[str, int]:
        """For each worker, how many leading blocks of the prompt it is believed to hold."""
        matched = {}
        for worker_id in worker_ids:
            held = self._blocks.get(worker_id)
            count = 0
            if held:
                for block in blocks:
                    if block not in held:
                        break
                    count += 1
            matched[worker_id] = count
        return matched

    def in_tier(self, worker_id: str, blocks: tuple[bytes, ...], paged_blocks: int) -> int:
        """Of `blocks` (held by the worker), how many were recorded longer ago than `paged_blocks`
        blocks: likely evicted from its paged cache to its KV tier."""
        held, clock = self._blocks.get(worker_id, {}), self._clock.get(worker_id, 0)
        return sum(1 for block in blocks if clock - held.get(block, clock) >= paged_blocks)

    def record(self, worker_id: str, blocks: tuple[bytes, ...], capacity_blocks: int) -> None:
        """The worker is about to compute these blocks: it will hold them (most recent last)."""
        held = self._blocks.setdefault(worker_id, OrderedDict())
        for block in blocks:
            self._clock[worker_id] = self._clock.get(worker_id, 0) + 1
            held[block] = self._clock[worker_id]
            held.move_to_end(block)
        while len(held) > capacity_blocks:
            held.popitem(last=False)

    def size(self, worker_id: str) -> int:
        return len(self._blocks.get(worker_id, ()))

    def forget(self, worker_id: str) -> None:
        self._blocks.pop(worker_id, None)
        self._clock.pop(worker_id, None)
