"""The router's approximate picture of each worker's prefix cache, without a tokenizer.

A prompt is cut into fixed-size character blocks, each identified by a chained hash (hash of the
previous block's hash and its characters), so equal hashes mean equal whole prefixes, as in the
workers' own block manager. For each worker the index keeps the blocks the router has sent it, least
recently used first out, up to a capacity matching the worker's KV cache and KV tier. Blocks sent
longer ago than its paged cache holds are taken to have gone down to its tier (`in_tier`). It is
an estimate: workers evict on their own schedule, and the index learns nothing from them.

Blocks pushed out of a worker's entry are still remembered as sent there (up to GHOST_FACTOR times
its capacity more), until it is sent them again or they age out: `placed_blocks` reads both. A cache
too small for its traffic has evicted them, so they are no saving now, but sending a prefix back
where it went before keeps each prefix's requests together, so the ones that follow find it cached.
How many blocks were pushed out lately, against the capacity, is the worker's eviction pressure.
"""

from __future__ import annotations

from collections import OrderedDict

GHOST_FACTOR = 4
PRESSURE_WINDOW = 32


class _Entry:
    """One worker's record: `held`, the blocks believed cached (least recently used first, each
    with the clock when last recorded); `ghosts`, blocks pushed out of `held` (oldest first, each
    with the clock when pushed out), none also held; `clock`, the blocks recorded so far; and the
    capacity of the latest record."""

    __slots__ = ("held", "ghosts", "clock", "capacity")

    def __init__(self) -> None:
        self.held: OrderedDict[bytes, int] = OrderedDict()
        self.ghosts: OrderedDict[bytes, int] = OrderedDict()
        self.clock = 0
        self.capacity = 0


class PrefixIndex:
    """Invariant: each worker's entry holds at most its capacity in blocks, most recently used last,
    each with the worker's record count when it was last recorded (its clock); its ghosts number at
    most GHOST_FACTOR times that capacity, pushed out of the entry within the last PRESSURE_WINDOW
    times capacity blocks recorded, none also in the entry."""

    def __init__(self):
        self._entries: dict[str, _Entry] = {}

    def matched_blocks(self, blocks: tuple[bytes, ...], worker_ids: list[str]) -> dict[str, int]:
        """For each worker, how many leading blocks of the prompt it is believed to hold."""
        matched = {}
        for worker_id in worker_ids:
            entry = self._entries.get(worker_id)
            matched[worker_id] = _leading(blocks, entry.held) if entry else 0
        return matched

    def placed_blocks(self, blocks: tuple[bytes, ...], worker_ids: list[str]) -> dict[str, int]:
        """For each worker, how many leading blocks of the prompt were last sent there, whether
        or not it is believed to hold them still (at least its matched_blocks)."""
        placed = {}
        for worker_id in worker_ids:
            entry = self._entries.get(worker_id)
            placed[worker_id] = _leading(blocks, entry.held, entry.ghosts) if entry else 0
        return placed

    def eviction_pressure(self, worker_id: str) -> float:
        """How many times over its cache the worker was sent blocks it could not keep lately: the
        blocks pushed out of its entry (and not sent again) while the last PRESSURE_WINDOW x
        capacity blocks were recorded, over its capacity. 0 for a cache that holds its traffic; up
        to GHOST_FACTOR."""
        entry = self._entries.get(worker_id)
        return len(entry.ghosts) / entry.capacity if entry and entry.capacity else 0.0

    def in_tier(self, worker_id: str, blocks: tuple[bytes, ...], paged_blocks: int) -> int:
        """Of `blocks` (held by the worker), how many were recorded longer ago than `paged_blocks`
        blocks: likely evicted from its paged cache to its KV tier."""
        entry = self._entries.get(worker_id)
        if entry is None:
            return 0
        return sum(1 for block in blocks if entry.clock - entry.held.get(block, entry.clock) >= paged_blocks)

    def record(self, worker_id: str, blocks: tuple[bytes, ...], capacity_blocks: int) -> None:
        """The worker is about to compute these blocks, or has just freed them: it holds them, the
        prompt's head the most recently used. A worker frees a sequence's blocks tail first and
        evicts the least recently freed, so of a prompt it keeps the head (a shared system prompt)
        longest; recorded tail first, the index forgets them in the same order."""
        entry = self._entries.setdefault(worker_id, _Entry())
        entry.capacity = capacity_blocks
        held, ghosts = entry.held, entry.ghosts
        for block in reversed(blocks):
            entry.clock += 1
            held[block] = entry.clock
            held.move_to_end(block)
            ghosts.pop(block, None)
        while len(held) > capacity_blocks:
            ghosts[held.popitem(last=False)[0]] = entry.clock
        while ghosts and (
            len(ghosts) > GHOST_FACTOR * capacity_blocks
            or entry.clock - next(iter(ghosts.values())) > PRESSURE_WINDOW * capacity_blocks
        ):
            ghosts.popitem(last=False)

    def size(self, worker_id: str) -> int:
        entry = self._entries.get(worker_id)
        return len(entry.held) if entry else 0

    def forget(self, worker_id: str) -> None:
        self._entries.pop(worker_id, None)


def _leading(blocks: tuple[bytes, ...], *sets: OrderedDict) -> int:
    """How many leading blocks are in any of `sets`."""
    count = 0
    for block in blocks:
        if not any(block in found for found in sets):
            break
        count += 1
    return count
