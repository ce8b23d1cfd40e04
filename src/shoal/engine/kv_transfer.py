"""KV blocks that move between engines: export a prefix's full blocks (their chained hashes, tokens
and each KV slot's keys and values) from one engine and import them into free blocks of another,
whose prefix cache then knows them, so a request for that prefix there computes none of it again.
A windowed KV group (shoal.model.kv_groups) carries only the blocks a query after the prefix
reaches (from one block earlier, where the sender still holds it, so that a receiver whose
prompt ends on the prefix's last block boundary finds it too).

Only compatible layouts move (shoal.engine.kv_layout). Only a one-process replica's cache moves (a
tensor-parallel or pipeline replica's cache is spread over processes).
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from dataclasses import dataclass
from multiprocessing import resource_tracker, shared_memory

import msgspec
import torch

from shoal.engine.block_manager import BlockManager, group_key
from shoal.engine.kv_layout import KVLayout
from shoal.protocol import kv_frames
from shoal.protocol.frames import WIRE_DTYPES, BadFrame, TensorSpec


class KVRefusedError(Exception):
    """The peer asked for blocks answered that it could not give them (the message says why)."""


@dataclass
class KVBlocks:
    """The KV of a prefix's first len(hashes) full blocks. Invariants: hashes[i] is the chained hash
    of token_ids up to the end of block i; KV group g carries blocks group_starts[g].. of the prefix;
    keys[s] and values[s] are [carried blocks of every group, in group order, num_kv_heads,
    block_size, head_dim] for KV slot s."""

    layout: KVLayout
    hashes: list[bytes]
    token_ids: list[int]
    group_starts: list[int]
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def num_tokens(self) -> int:
        return len(self.hashes) * self.layout.block_size

    @property
    def nbytes(self) -> int:
        """The size of the keys and values."""
        return sum(t.nbytes for t in (*self.keys, *self.values))


def export_prefix(
    layout: KVLayout, blocks: BlockManager, caches: list[tuple[torch.Tensor, torch.Tensor]], token_ids: list[int]
) -> KVBlocks:
    """The cached full blocks of the longest prefix of `token_ids` this engine holds (possibly none)."""
    size, groups = layout.block_size, blocks.groups
    hashes = blocks.chain(token_ids, len(token_ids) // size)
    found, claimed = blocks.claim_prefix(hashes)
    try:
        starts, ids = [], []
        for group in range(groups.count):
            start = groups.first_needed_block(group, found * size, size)
            earliest = groups.first_needed_block(group, max(0, found - 1) * size, size)
            while start > earliest and group_key(hashes[start - 1], group) in blocks.hash_index:
                start -= 1
            starts.append(start)
            ids.extend(
                claimed[(group, i)] if (group, i) in claimed else blocks.hash_index[group_key(hashes[i], group)]
                for i in range(start, found)
            )
        index = torch.tensor(ids, dtype=torch.long, device=caches[0][0].device)
        return KVBlocks(
            layout,
            hashes[:found],
            list(token_ids[: found * size]),
            starts,
            [k.index_select(0, index).cpu() for k, _ in caches],
            [v.index_select(0, index)[..., : layout.head_dim].cpu() for _, v in caches],
        )
    finally:
        blocks.release_claimed(claimed)


def import_blocks(
    layout: KVLayout, blocks: BlockManager, caches: list[tuple[torch.Tensor, torch.Tensor]], incoming: KVBlocks
) -> int:
    """Copies the blocks this engine does not hold yet into free blocks and adds them to its prefix
    cache (free, so they are evicted like any cached block). Returns how many were imported.
    Raises KVLayoutMismatch (before touching anything) if the layouts differ, ValueError if the
    hashes do not chain over the tokens."""
    layout.check_compatible(incoming.layout)
    chained = blocks.chain(incoming.token_ids, len(incoming.hashes))
    for i, (digest, expected) in enumerate(zip(incoming.hashes, chained, strict=True)):
        if digest != expected:
            raise ValueError(f"block {i}'s hash does not match its tokens")
    rows, keys, offset = [], [], 0
    for group, start in enumerate(incoming.group_starts):
        for i in range(start, len(incoming.hashes)):
            key = group_key(incoming.hashes[i], group)
            if key not in blocks.hash_index:
                rows.append(offset + i - start)
                keys.append(key)
        offset += len(incoming.hashes) - start
    targets = blocks.reserve_free(len(rows))
    try:
        device = caches[0][0].device
        source = torch.tensor(rows, dtype=torch.long)
        target = torch.tensor(targets, dtype=torch.long, device=device)
        for (k_cache, v_cache), keys_in, values_in in zip(caches, incoming.keys, incoming.values, strict=True):
            k_cache.index_copy_(0, target, keys_in.index_select(0, source).to(device, k_cache.dtype))
            v_cache[..., : layout.head_dim].index_copy_(
                0, target, values_in.index_select(0, source).to(device, v_cache.dtype)
            )
    except BaseException:
        blocks.release_reserved(targets, [])
        raise
    blocks.release_reserved(targets, keys)
    return len(rows)


def to_frames(blocks: KVBlocks) -> list[bytes | memoryview]:
    """The blocks as a multipart message (shoal.protocol.kv_frames): header, then each layer's keys
    and values as raw buffers."""
    return _frames(blocks, shared=False)[0]


def to_shared_frames(blocks: KVBlocks) -> tuple[list[bytes | memoryview], str | None]:
    """For a receiver on this host: the header alone, the buffers in a new shared-memory segment
    it names (and returned, None when there is no block), which the receiver unlinks."""
    return _frames(blocks, shared=True)


def _frames(blocks: KVBlocks, shared: bool) -> tuple[list[bytes | memoryview], str | None]:
    tensors = [t.contiguous() for pair in zip(blocks.keys, blocks.values, strict=True) for t in pair]
    segment = _to_segment(tensors) if shared and blocks.hashes else None
    header = kv_frames.KVBlocksHeader(
        kv_frames.KVLayoutFrame(**dataclasses.asdict(blocks.layout)),
        list(blocks.hashes),
        list(blocks.token_ids),
        list(blocks.group_starts),
        [TensorSpec(tuple(t.shape), blocks.layout.dtype) for t in tensors],
        shared_memory=segment,
    )
    if segment:
        return [kv_frames.encode(header)], segment
    return [kv_frames.encode(header), *(_raw(t) for t in tensors)], None


def _to_segment(tensors: list[torch.Tensor]) -> str:
    """A new shared-memory segment holding the tensors' bytes one after another; its name."""
    sizes = [t.nbytes for t in tensors]
    segment = shared_memory.SharedMemory(f"shoal-kv-{secrets.token_hex(16)}", create=True, size=sum(sizes))
    try:
        offset = 0
        for tensor, size in zip(tensors, sizes, strict=True):
            segment.buf[offset : offset + size] = _raw(tensor)
            offset += size
    except BaseException:
        segment.unlink()
        raise
    finally:
        segment.close()
    resource_tracker.unregister(segment._name, "shared_memory")  # the receiver's to unlink, not this process's
    return segment.name


def _from_segment(name: str, specs: list[TensorSpec], dtype: torch.dtype) -> list[torch.Tensor]:
    """The tensors of a segment made by _to_segment, copied out; the segment is unlinked."""
    try:
        segment = shared_memory.SharedMemory(name)
    except FileNotFoundError:
        raise BadFrame(f"shared-memory segment {name} is gone") from None
    try:
        sizes = [math.prod(spec.shape) * WIRE_DTYPES[spec.dtype] for spec in specs]
        if sum(sizes) > segment.size:
            raise BadFrame(f"shared-memory segment {name} holds {segment.size} bytes, not {sum(sizes)}")
        tensors, offset = [], 0
        for spec, size in zip(specs, sizes, strict=True):
            tensors.append(
                torch.frombuffer(bytearray(segment.buf[offset : offset + size]), dtype=dtype).view(spec.shape)
            )
            offset += size
        return tensors
    finally:
        segment.close()
        segment.unlink()


def _raw(tensor: torch.Tensor) -> bytes | memoryview:
    """A contiguous tensor's bytes, without a copy (an empty one: no bytes)."""
    return memoryview(tensor.view(torch.uint8).numpy()).cast("B") if tensor.numel() else b""


def from_frames(frames: list[bytes | memoryview]) -> KVBlocks:
    """The blocks of a multipart message; BadFrame (before any buffer is read) unless every frame is
    what the header says; KVRefusedError for the peer's refusal."""
    header = kv_frames.decode(frames)
    if isinstance(header, kv_frames.KVRefused):
        raise KVRefusedError(header.reason)
    layout = KVLayout(**msgspec.structs.asdict(header.layout))
    dtype = getattr(torch, layout.dtype)
    if header.shared_memory:
        tensors = _from_segment(header.shared_memory, header.tensors, dtype)
        return KVBlocks(
            layout, list(header.hashes), list(header.token_ids), list(header.group_starts), tensors[0::2], tensors[1::2]
        )
    tensors = [
        torch.frombuffer(bytearray(frame), dtype=dtype).view(tuple(spec.shape))
        if len(frame)
        else torch.empty(tuple(spec.shape), dtype=dtype)  # no block: torch reads no empty buffer
        for spec, frame in zip(header.tensors, frames[1:], strict=True)
    ]
    return KVBlocks(
        layout, list(header.hashes), list(header.token_ids), list(header.group_starts), tensors[0::2], tensors[1::2]
    )
