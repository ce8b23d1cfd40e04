"""Paged KV-cache block allocator with reference counts and automatic prefix caching.

A full block is identified by a chained hash of (hash of the previous block, its tokens), so equal
hashes mean equal whole prefixes. Freed blocks keep their hash and stay reusable until the
allocator needs them for something else (least recently freed first; a sequence's tail blocks are
freed before its head, so shared prefixes live longest). With a KV tier (shoal.engine.kv_tier), a
cached block is spilled there when it is reused, and a prefix lookup that misses here continues
there: a block found is written into a free block and counts as cached.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from typing import Any, Protocol

from shoal.engine.sequence import Sequence


class Tier(Protocol):
    """Where evicted cached blocks go and come back from (shoal.engine.kv_tier.TierLink; the
    simulator's SimulatedTier)."""

    def spill(self, digest: bytes, block: int) -> None: ...

    def fetch(self, digest: bytes) -> Any | None: ...

    def write(self, block: int, data: Any) -> None: ...


def chain_hash(parent: bytes | None, tokens: list[int]) -> bytes:
    """Hash of a full block given its parent's hash; collision-resistant (blake2b, 128 bits)."""
    digest = hashlib.blake2b(digest_size=16)
    if parent is not None:
        digest.update(parent)
    digest.update(array("q", tokens).tobytes())
    return digest.digest()


class BlockManager:
    """Owns blocks 0..num_blocks-1.

    Invariants (checked by `check_integrity`): a block's ref_count equals the number of live block
    tables that hold it; a block is in the free queue iff its ref_count is 0; every entry of the
    hash index points at a block carrying that hash.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.hash_index: dict[bytes, int] = {}
        # Chained hashes of each live sequence's full, computed blocks.
        self.seq_hashes: dict[str, list[bytes]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.tier: Tier | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Attaches cached blocks for the longest cached prefix of a WAITING sequence.

        At least one token is always left to compute (its logits are needed). Returns the number of
        tokens found in the cache; the caller sets num_computed_tokens from it.
        """
        assert not seq.block_table, "sequence already holds blocks"
        tokens = seq.all_token_ids
        hashes: list[bytes] = []
        if self.enable_prefix_caching:
            parent = None
            max_blocks = (len(tokens) - 1) // self.block_size
            for i in range(max_blocks):
                parent = chain_hash(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
                block = self.hash_index.get(parent)
                if block is None:
                    block = self._from_tier(parent)
                if block is None:
                    break
                hashes.append(parent)
                self._take(block)
                seq.block_table.append(block)
        self.seq_hashes[seq.request_id] = hashes
        cached = len(hashes) * self.block_size
        self.prefix_queries += len(tokens)
        self.prefix_hits += cached
        return cached

    def can_append(self, seq: Sequence, num_new_tokens: int) -> bool:
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        return needed <= self.num_free_blocks

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Ensures slots for the next num_new_tokens tokens; False (and no change) if blocks ran out."""
        if not self.can_append(seq, num_new_tokens):
            return False
        needed = self.blocks_needed(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        for _ in range(needed):
            block, _ = self.free_queue.popitem(last=False)
            self._evict(block)
            self.ref_counts[block] = 1
            seq.block_table.append(block)
        return True

    def commit_computed(self, seq: Sequence) -> None:
        """Registers the hashes of blocks that became full after the sequence's last step."""
        if not self.enable_prefix_caching:
            return
        hashes = self.seq_hashes[seq.request_id]
        full_blocks = seq.num_computed_tokens // self.block_size
        if len(hashes) >= full_blocks:
            return
        tokens = seq.all_token_ids
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), full_blocks):
            parent = chain_hash(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(parent)
            block = seq.block_table[i]
            if parent not in self.hash_index and self.block_hashes[block] is None:
                self.hash_index[parent] = block
                self.block_hashes[block] = parent

    def free(self, seq: Sequence) -> None:
        """Releases the sequence's blocks, tail first; cached blocks stay findable until reused."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
        seq.block_table = []
        self.seq_hashes.pop(seq.request_id, None)

    def forget_free_cached(self) -> None:
        """Drops free blocks from the prefix cache (their KV content can no longer be trusted)."""
        for block in self.free_queue:
            self._forget_hash(block)

    def reserve_free(self, count: int) -> list[int]:
        """Takes `count` blocks out of the free queue (least recently freed first, dropping what
        they cached) for an import to fill; ValueError if fewer are free. They belong to no
        sequence and must be handed back with release_reserved before the next step."""
        if count > len(self.free_queue):
            raise ValueError(f"{count} KV blocks to import, {len(self.free_queue)} free")
        reserved = []
        for _ in range(count):
            block, _ = self.free_queue.popitem(last=False)
            self._evict(block)
            reserved.append(block)
        return reserved

    def release_reserved(self, reserved: list[int], hashes: list[bytes]) -> None:
        """Hands reserved blocks back as free; block i caches hashes[i] when given (an import cut
        short gives none). Tail first, as `free` does, so a prefix's head is evicted last."""
        for i in reversed(range(len(reserved))):
            block = reserved[i]
            if i < len(hashes) and hashes[i] not in self.hash_index:
                self.hash_index[hashes[i]] = block
                self.block_hashes[block] = hashes[i]
            self.free_queue[block] = None

    def _from_tier(self, digest: bytes) -> int | None:
        """A free block now holding the tier's copy of `digest` (cached, free), or None."""
        if self.tier is None or not self.free_queue:
            return None
        data = self.tier.fetch(digest)  # before any eviction below can push it out of the tier
        if data is None:
            return None
        block, _ = self.free_queue.popitem(last=False)
        self._evict(block)
        self.tier.write(block, data)
        self.hash_index[digest] = block
        self.block_hashes[block] = digest
        self.free_queue[block] = None
        return block

    def _evict(self, block: int) -> None:
        """A free block is reused: what it cached goes to the tier, if there is one."""
        digest = self.block_hashes[block]
        if digest is not None and self.tier is not None and self.hash_index.get(digest) == block:
            self.tier.spill(digest, block)
        self._forget_hash(block)

    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def _forget_hash(self, block: int) -> None:
        old = self.block_hashes[block]
        if old is not None:
            if self.hash_index.get(old) == block:
                del self.hash_index[old]
            self.block_hashes[block] = None

    def check_integrity(self, live: list[Sequence]) -> None:
        """Raises AssertionError if any invariant is broken. `live` = sequences holding blocks."""
        owners = Counter(b for seq in live for b in seq.block_table)
        for seq in live:
            assert len(set(seq.block_table)) == len(seq.block_table), f"{seq.request_id} holds a block twice"
        for block in range(self.num_blocks):
            assert self.ref_counts[block] == owners.get(block, 0), f"block {block} ref count mismatch"
            assert (self.ref_counts[block] == 0) == (block in self.free_queue), f"block {block} free-queue mismatch"
        for digest, block in self.hash_index.items():
            assert self.block_hashes[block] == digest, f"hash index points at block {block} with another hash"
        assert set(self.seq_hashes) <= {seq.request_id for seq in live}, "hashes kept for a dead sequence"
