"""KV blocks on the wire: one header frame (KVBlocksHeader: the layout, the blocks' chained hashes
and tokens, the first block each KV group carries, the spec of each tensor), then per KV slot a keys
frame and a values frame of raw buffers, [blocks carried over all groups, kv heads, block size, head
size] each. decode checks that the frames are exactly what the
header says (count, shapes, dtype, sizes) before anyone reads a buffer; anything else is BadFrame.

Between workers (shoal.worker.kv_peer) a request is one KVWanted frame; the answer is the blocks,
or one KVRefused frame saying why not. A requester on the same host (the same `host` key) may get
the tensors in a shared-memory segment instead of frames: the header names it (`shared_memory`)
and comes alone; the tensors lie in the segment one after another, as the specs say, and the
requester unlinks the segment once it has read it.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from shoal.protocol.frames import WIRE_DTYPES, BadFrame, TensorSpec, decode_header

HASH_BYTES = 16
SEGMENT_PATTERN = "^shoal-kv-[0-9a-f]{32}$"
Positive = Annotated[int, msgspec.Meta(ge=1)]


class KVLayoutFrame(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """shoal.engine.kv_transfer.KVLayout, field for field."""

    model: Annotated[str, msgspec.Meta(max_length=64)]
    dtype: str
    block_size: Positive
    kv_slots: Positive
    kv_groups: Positive
    num_kv_heads: Positive
    head_dim: Positive


class KVBlocksHeader(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    layout: KVLayoutFrame
    hashes: list[Annotated[bytes, msgspec.Meta(min_length=HASH_BYTES, max_length=HASH_BYTES)]]
    token_ids: list[Annotated[int, msgspec.Meta(ge=0)]]
    group_starts: list[Annotated[int, msgspec.Meta(ge=0)]]  # the first block of the prefix each KV group carries
    tensors: list[TensorSpec]  # keys of KV slot 0, values of slot 0, keys of slot 1, ...
    shared_memory: Annotated[str, msgspec.Meta(pattern=SEGMENT_PATTERN)] | None = None


class KVRefused(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """The answer to a request the peer could not serve."""

    reason: Annotated[str, msgspec.Meta(max_length=1000)]


class KVWanted(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """A request for the KV of the longest cached prefix of these tokens."""

    token_ids: Annotated[list[Annotated[int, msgspec.Meta(ge=0)]], msgspec.Meta(max_length=1 << 20)]
    host: Annotated[str, msgspec.Meta(max_length=200)] | None = None  # the requester's host key


DECODER = msgspec.msgpack.Decoder(KVBlocksHeader | KVRefused)
REQUEST_DECODER = msgspec.msgpack.Decoder(KVWanted)
ENCODER = msgspec.msgpack.Encoder()


def encode(header: KVBlocksHeader | KVRefused | KVWanted) -> bytes:
    return ENCODER.encode(header)


def decode_request(frames: list[bytes | memoryview]) -> KVWanted:
    if len(frames) != 1:
        raise BadFrame(f"a KV request came in {len(frames)} frames, not 1")
    return decode_header(REQUEST_DECODER, frames[0])


def decode(frames: list[bytes | memoryview]) -> KVBlocksHeader | KVRefused:
    """The header of a multipart KV message whose tensor frames (frames[1:]) are checked against it,
    or the peer's refusal."""
    if not frames:
        raise BadFrame("empty message")
    header = decode_header(DECODER, frames[0])
    if isinstance(header, KVRefused):
        if len(frames) != 1:
            raise BadFrame("a refusal carries no tensor")
        return header
    layout = header.layout
    if layout.dtype not in WIRE_DTYPES:
        raise BadFrame(f"KV dtype {layout.dtype!r} is not one of {sorted(WIRE_DTYPES)}")
    blocks = len(header.hashes)
    if len(header.token_ids) != blocks * layout.block_size:
        raise BadFrame(f"{len(header.token_ids)} tokens for {blocks} blocks of {layout.block_size}")
    if len(header.group_starts) != layout.kv_groups or any(start > blocks for start in header.group_starts):
        raise BadFrame(f"group starts {header.group_starts} for {layout.kv_groups} KV groups of {blocks} blocks")
    expected = 2 * layout.kv_slots
    frames_expected = 1 if header.shared_memory else 1 + expected
    if len(header.tensors) != expected or len(frames) != frames_expected:
        raise BadFrame(f"{len(header.tensors)} tensor specs and {len(frames) - 1} tensor frames, not {expected}")
    carried = sum(blocks - start for start in header.group_starts)
    shape = (carried, layout.num_kv_heads, layout.block_size, layout.head_dim)
    for spec in header.tensors:
        if tuple(spec.shape) != shape or spec.dtype != layout.dtype:
            raise BadFrame(f"a KV tensor of shape {list(spec.shape)} {spec.dtype}, not {list(shape)} {layout.dtype}")
    for spec, frame in zip(header.tensors, frames[1:], strict=False):
        spec.check(len(frame))
    return header
