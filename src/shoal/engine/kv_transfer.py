"""KV blocks that move between engines: export a prefix's full blocks (their chained hashes, tokens
and per-layer keys and values) from one engine and import them into free blocks of another, whose
prefix cache then knows them, so a request for that prefix there computes none of it again.

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

from shoal.engine.block_manager import BlockManager, chain_hash
from shoal.engine.kv_layout import KVLayout
from shoal.protocol import kv_frames
from shoal.protocol.frames import WIRE_DTYPES, BadFrame, TensorSpec


class KVRefusedError(Exception):
    """The peer asked for blocks answered that it could not give them (the message says why)."""


@dataclass
class KVBlocks:
    """The KV of a prefix's first len(hashes) full blocks. Invariants: hashes[i] is the chained hash
    of token_ids up to the end of block i; keys[l] and values[l] are [len(hashes), num_kv_heads,
    block_size, head_dim] for layer l."""

    layout: KVLayout
    hashes: list[bytes]
    token_ids: list[int]
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
    size = layout.block_size
    hashes, ids, parent = [], [], None
    for start in range(0, len(token_ids) - size + 1, size):
        parent = chain_hash(parent, token_ids[start : start + size])
        block = blocks.hash_index.get(parent)
        if block is None:
            break
        hashes.append(parent)
        ids.append(block)
    index = torch.tensor(ids, dtype=torch.long, device=caches[0][0].device)
    head_dim = layout.head_dim
    return KVBlocks(
        layout,
        hashes,
        list(token_ids[: len(hashes) * size]),
        [k.index_select(0, index).cpu() for k, _ in caches],
        [v.index_select(0, index)[..., :head_dim].cpu() for _, v in caches],
    )


def import_blocks(
    layout: KVLayout, blocks: BlockManager, caches: list[tuple[torch.Tensor, torch.Tensor]], incoming: KVBlocks
) -> int:
    """Copies the blocks this engine does not hold yet into free blocks and adds them to its prefix
    cache (free, so they are evicted like any cached block). Returns how many were imported.
    Raises KVLayoutMismatch (before touching anything) if the layouts differ, ValueError if the
    hashes do not chain over the tokens."""
    layout.check_compatible(incoming.layout)
    size = layout.block_size
    parent = None
    for i, digest in enumerate(incoming.hashes):
        parent = chain_hash(parent, incoming.token_ids[i * size : (i + 1) * size])
        if parent != digest:
            raise ValueError(f"block {i}'s hash does not match its tokens")
    wanted = [i for i, digest in enumerate(incoming.hashes) if digest not in blocks.hash_index]
    targets = blocks.reserve_free(len(wanted))
    try:
        device = caches[0][0].device
        source = torch.tensor(wanted, dtype=torch.long)
        target = torch.tensor(targets, dtype=torch.long, device=device)
        for (k_cache, v_cache), keys, values in zip(caches, incoming.keys, incoming.values, strict=True):
            k_cache.index_copy_(0, target, keys.index_select(0, source).to(device, k_cache.dtype))
            v_cache[..., : layout.head_dim].index_copy_(
                0, target, values.index_select(0, source).to(device, v_cache.dtype)
            )
    except BaseException:
        blocks.release_reserved(targets, [])
        raise
    blocks.release_reserved(targets, [incoming.hashes[i] for i in wanted])
    return len(wanted)


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
        return KVBlocks(layout, list(header.hashes), list(header.token_ids), tensors[0::2], tensors[1::2])
    tensors = [
        torch.frombuffer(bytearray(frame), dtype=dtype).view(tuple(spec.shape))
        if len(frame)
        else torch.empty(tuple(spec.shape), dtype=dtype)  # no block: torch reads no empty buffer
        for spec, frame in zip(header.tensors, frames[1:], strict=True)
    ]
    return KVBlocks(layout, list(header.hashes), list(header.token_ids), tensors[0::2], tensors[1::2])
