"""Paged KV-cache block allocator with reference counts and automatic prefix caching.

One pool of blocks serves the model's KV groups (shoal.model.kv_groups): a sequence holds a block
table per group, and a windowed group's table points at NULL_BLOCK where its blocks slid out of
every query's reach (they are freed then, and stay cached).

A full block is identified by a chained hash of (hash of the previous block, its tokens), so equal
hashes mean equal whole prefixes; a group's block is cached under that hash qualified by the group
(`group_key`), since each group keeps other layers' KV in it. A prefix is found when every full
group holds all its blocks and every windowed group the blocks the next query reaches. Freed
blocks keep their hash and stay reusable until the allocator needs them for something else (least
recently freed first; a sequence's tail blocks are freed before its head, so shared prefixes live
longest). With a KV tier (shoal.engine.kv_tier), a
cached block is spilled there when it is reused, and a prefix lookup that misses here continues
there: a block found is written into a free block and counts as cached. With an event log
(shoal.engine.kv_event_log), each hash the cache gains or loses is published as it happens.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict
from typing import Any, Protocol

from shoal.engine.kv_event_log import KvEventLog
from shoal.engine.sequence import Sequence
from shoal.model.kv_groups import NULL_BLOCK, KVGroups
from shoal.protocol.kv_events import DEVICE


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


def group_key(digest: bytes, group: int) -> bytes:
    """The cache key of group `group`'s block for the prefix hashed `digest` (group 0: the digest)."""
    if group == 0:
        return digest
    return hashlib.blake2b(digest, digest_size=16, salt=group.to_bytes(16, "little")).digest()


class BlockManager:
    """Owns blocks 0..num_blocks-1 (but NULL_BLOCK where a group is windowed).

    Invariants (checked by `check_integrity`): a block's ref_count equals the number of entries of
    live block tables that hold it; a block is in the free queue iff its ref_count is 0 (NULL_BLOCK,
    when reserved, never is); every entry of the hash index points at a block carrying that key.
    """

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, groups: KVGroups | None = None
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = groups or KVGroups.full(1)
        self.reserved = 1 if self.groups.windowed else 0
        self.ref_counts = [0] * num_blocks
        self.block_hashes: list[bytes | None] = [None] * num_blocks
        self.free_queue: OrderedDict[int, None] = OrderedDict((b, None) for b in range(self.reserved, num_blocks))
        self.hash_index: dict[bytes, int] = {}
        # Chained hashes of each live sequence's full, computed blocks.
        self.seq_hashes: dict[str, list[bytes]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.tier: Tier | None = None
        # Where the device level's events go (a cache of one KV group only).
        self.events: KvEventLog | None = None

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_usable_blocks(self) -> int:
        """The blocks sequences can hold (all but a reserved NULL_BLOCK)."""
        return self.num_blocks - self.reserved

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_usable_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        """Blocks of one group's table that cover `num_tokens` positions."""
        return -(-num_tokens // self.block_size)

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """Attaches cached blocks for the longest cached prefix of a WAITING sequence.

        At least one token is always left to compute (its logits are needed). Returns the number of
        tokens found in the cache; the caller sets num_computed_tokens from it.
        """
        assert not seq.block_tables, "sequence already holds blocks"
        tokens = seq.all_token_ids
        blocks = (len(tokens) - 1) // self.block_size
        hashes = self.chain(tokens, blocks, seq.cache_salt) if self.enable_prefix_caching else []
        found, claimed = self.claim_prefix(hashes)
        seq.block_tables = [self.prefix_table(group, found, claimed) for group in range(self.groups.count)]
        self.release_claimed(claimed)
        self.seq_hashes[seq.request_id] = hashes[:found]
        cached = found * self.block_size
        self.prefix_queries += len(tokens)
        self.prefix_hits += cached
        return cached

    def chain(self, tokens: list[int], num_blocks: int, salt: bytes | None = None) -> list[bytes]:
        """The chained hashes of the first `num_blocks` full blocks of `tokens`, from `salt` (what
        computed them besides the tokens: a LoRA adapter; None for the base model)."""
        hashes, parent = [], salt
        for i in range(num_blocks):
            parent = chain_hash(parent, tokens[i * self.block_size : (i + 1) * self.block_size])
            hashes.append(parent)
        return hashes

    def claim_prefix(self, hashes: list[bytes]) -> tuple[int, dict[tuple[int, int], int]]:
        """The most blocks k of the prefix `hashes` that this cache (or its tier, whose blocks are
        brought in) holds as a query at position k * block_size needs them: every block before k in
        full groups, those from the window's start on in windowed ones; and the blocks looked at,
        {(group, index): block}, each taken (its ref count raised, so no tier fetch evicts it
        meanwhile). The caller owns them: it keeps some (`prefix_table`) and releases the rest."""
        claimed: dict[tuple[int, int], int] = {}

        def holds(group: int, index: int) -> bool:
            if (group, index) not in claimed:
                key = group_key(hashes[index], group)
                block = self.hash_index.get(key)
                block = self._from_tier(key) if block is None else block
                if block is None:
                    return False
                self._take(block)
                claimed[(group, index)] = block
            return True

        found = len(hashes)
        windows = self.groups.windows
        for group in (g for g, window in enumerate(windows) if not window):
            found = next((i for i in range(found) if not holds(group, i)), found)
        while found and not all(
            holds(group, i)
            for group in (g for g, window in enumerate(windows) if window)
            for i in range(self.groups.first_needed_block(group, found * self.block_size, self.block_size), found)
        ):
            found -= 1
        return found, claimed

    def prefix_table(self, group: int, found: int, claimed: dict[tuple[int, int], int]) -> list[int]:
        """Group `group`'s table of a `found`-block prefix claimed by claim_prefix (its blocks leave
        `claimed`): NULL_BLOCK below the reach of a query at its end."""
        first = self.groups.first_needed_block(group, found * self.block_size, self.block_size)
        return [NULL_BLOCK] * first + [claimed.pop((group, i)) for i in range(first, found)]

    def release_claimed(self, claimed: dict[tuple[int, int], int]) -> None:
        for block in claimed.values():
            self._release(block)
        claimed.clear()

    def append_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Ensures slots for the next num_new_tokens tokens; False (and no block taken) if blocks ran
        out. Blocks out of the reach of every query from the next one on are freed first."""
        self._free_out_of_reach(seq)
        if self._new_blocks(seq, num_new_tokens) > self.num_free_blocks:
            return False
        length = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        for table in seq.block_tables:
            for _ in range(length - len(table)):
                block, _ = self.free_queue.popitem(last=False)
                self._evict(block)
                self.ref_counts[block] = 1
                table.append(block)
        return True

    def release_beyond(self, seq: Sequence, num_tokens: int) -> None:
        """Gives back the blocks past the first `num_tokens` slots (those only rejected drafts
        used); a block past them holds no registered hash (only computed tokens' blocks do)."""
        length = self.blocks_needed(num_tokens)
        for table in seq.block_tables:
            while len(table) > length:
                block = table.pop()
                if self._real(block):
                    self._release(block)

    def tokens_appendable(self, seq: Sequence, wanted: int) -> int:
        """The most of the next `wanted` tokens whose slots the free blocks hold (after the blocks
        out of reach are freed): a chunk of prefill that fits where the whole one does not."""
        self._free_out_of_reach(seq)
        low, high = 0, wanted
        while low < high:
            middle = (low + high + 1) // 2
            if self._new_blocks(seq, middle) <= self.num_free_blocks:
                low = middle
            else:
                high = middle - 1
        return low

    def _new_blocks(self, seq: Sequence, num_new_tokens: int) -> int:
        length = self.blocks_needed(seq.num_computed_tokens + num_new_tokens)
        return sum(length - len(table) for table in seq.block_tables)

    def _free_out_of_reach(self, seq: Sequence) -> None:
        """Windowed groups give back (still cached) the blocks no query from the next one reads."""
        for group, table in enumerate(seq.block_tables):
            first = self.groups.first_needed_block(group, seq.num_computed_tokens, self.block_size)
            for index in range(min(first, len(table))):
                if self._real(table[index]):
                    self._release(table[index])
                    table[index] = NULL_BLOCK

    def commit_computed(self, seq: Sequence) -> None:
        """Registers the hashes of blocks that became full after the sequence's last step."""
        if not self.enable_prefix_caching:
            return
        hashes = self.seq_hashes[seq.request_id]
        tokens, size = seq.all_token_ids, self.block_size
        parent = hashes[-1] if hashes else seq.cache_salt
        stored = []
        for i in range(len(hashes), seq.num_computed_tokens // size):
            parent = chain_hash(parent, tokens[i * size : (i + 1) * size])
            hashes.append(parent)
            for group, table in enumerate(seq.block_tables):
                if self._real(table[i]) and self._register(group_key(parent, group), table[i]):
                    stored.append(parent)
        if self.events is not None:
            self.events.stored(DEVICE, stored)

    def _register(self, key: bytes, block: int) -> bool:
        """Whether the block now caches `key` (False: the key or the block was taken)."""
        if key not in self.hash_index and self.block_hashes[block] is None:
            self.hash_index[key] = block
            self.block_hashes[block] = key
            return True
        return False

    def free(self, seq: Sequence) -> None:
        """Releases the sequence's blocks, tail first; cached blocks stay findable until reused."""
        for table in seq.block_tables:
            for block in reversed(table):
                if self._real(block):
                    self._release(block)
        seq.block_tables = []
        self.seq_hashes.pop(seq.request_id, None)

    def _real(self, block: int) -> bool:
        """Whether a table entry is a block of the pool (not the reserved NULL_BLOCK)."""
        return block != NULL_BLOCK or not self.reserved

    def _release(self, block: int) -> None:
        self.ref_counts[block] -= 1
        if self.ref_counts[block] == 0:
            self.free_queue[block] = None

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

    def release_reserved(self, reserved: list[int], keys: list[bytes]) -> None:
        """Hands reserved blocks back as free; block i caches keys[i] (a group_key) when given (an
        import cut short gives none). Tail first, as `free` does, so a prefix's head is evicted last."""
        stored = []
        for i in reversed(range(len(reserved))):
            block = reserved[i]
            if i < len(keys) and self._register(keys[i], block):
                stored.append(keys[i])
            self.free_queue[block] = None
        if self.events is not None:
            self.events.stored(DEVICE, stored)

    def _from_tier(self, key: bytes) -> int | None:
        """A free block now holding the tier's copy of `key` (cached, free), or None."""
        if self.tier is None or not self.free_queue:
            return None
        data = self.tier.fetch(key)  # before any eviction below can push it out of the tier
        if data is None:
            return None
        block, _ = self.free_queue.popitem(last=False)
        self._evict(block)
        self.tier.write(block, data)
        self.hash_index[key] = block
        self.block_hashes[block] = key
        self.free_queue[block] = None
        if self.events is not None:
            self.events.stored(DEVICE, [key])
        return block

    def _evict(self, block: int) -> None:
        """A free block is reused: what it cached goes to the tier, if there is one."""
        key = self.block_hashes[block]
        if key is not None and self.tier is not None and self.hash_index.get(key) == block:
            self.tier.spill(key, block)
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
                if self.events is not None:
                    self.events.removed(DEVICE, [old])
            self.block_hashes[block] = None

    def check_integrity(self, live: list[Sequence]) -> None:
        """Raises AssertionError if any invariant is broken. `live` = sequences holding blocks."""
        owners = Counter(b for seq in live for table in seq.block_tables for b in table if self._real(b))
        for seq in live:
            assert len(seq.block_tables) == self.groups.count, f"{seq.request_id} holds {len(seq.block_tables)} tables"
            blocks = [b for table in seq.block_tables for b in table if self._real(b)]
            assert len(set(blocks)) == len(blocks), f"{seq.request_id} holds a block twice"
        for block in range(self.reserved, self.num_blocks):
            assert self.ref_counts[block] == owners.get(block, 0), f"block {block} ref count mismatch"
            assert (self.ref_counts[block] == 0) == (block in self.free_queue), f"block {block} free-queue mismatch"
        assert not self.reserved or (NULL_BLOCK not in self.free_queue and not owners.get(NULL_BLOCK)), "null block"
        for key, block in self.hash_index.items():
            assert self.block_hashes[block] == key, f"hash index points at block {block} with another hash"
        assert set(self.seq_hashes) <= {seq.request_id for seq in live}, "hashes kept for a dead sequence"
