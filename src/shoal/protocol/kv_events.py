"""KV events: what a worker's prefix cache gained and lost, as typed frames a router follows.

A worker numbers its events from 1 within an epoch (a random name drawn when its engine starts); a
router that follows it applies each event once, in order, to a `KvState` of its own (shoal.protocol.
kv_state), which then equals the worker's. A router that joins, sees another epoch, or misses a
number asks for a `KvSnapshot`: the whole state as of one number, from which the events go on.

Levels are where a block is: the paged cache on the device, or the worker's KV tier in host memory
or on its disk (shoal.engine.kv_tier). Blocks are named by the engine's chained token-block hashes
(shoal.engine.block_manager.chain_hash), prompts by the router's prefix keys (shoal.protocol.
prefix_keys): `PromptMapped` tells which blocks each key of a prompt needs.

Frames travel as msgpack, each behind a 4-byte big-endian length; `decode_frame` builds only the
structs named here (BadFrame otherwise).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from shoal.protocol.frames import BadFrame

DEVICE, HOST, DISK = 1, 2, 4
LEVELS = {"device": DEVICE, "host": HOST, "disk": DISK}
MAX_FRAME_BYTES = 64 << 20
Digest = Annotated[bytes, msgspec.Meta(min_length=1, max_length=32)]
Level = Annotated[int, msgspec.Meta(ge=1, le=DISK)]


class BlocksStored(msgspec.Struct, tag="stored", frozen=True, forbid_unknown_fields=True):
    """These blocks are now held at `level`."""

    level: Level
    digests: list[Digest]


class BlocksRemoved(msgspec.Struct, tag="removed", frozen=True, forbid_unknown_fields=True):
    """These blocks are no longer held at `level`."""

    level: Level
    digests: list[Digest]


class PromptMapped(msgspec.Struct, tag="mapped", frozen=True, forbid_unknown_fields=True):
    """A prompt's token blocks (`chain`, each block's parent the one before it, the first's none) and
    its prefix keys: a request with the prefix named keys[i] finds cached what chain[:blocks[i]]
    holds (1 <= blocks[i] <= len(chain))."""

    chain: list[Digest]
    keys: list[Digest]
    blocks: list[Annotated[int, msgspec.Meta(ge=1)]]


Event = BlocksStored | BlocksRemoved | PromptMapped


class KvEvents(msgspec.Struct, tag="events", frozen=True, forbid_unknown_fields=True):
    """Events numbered first, first + 1, ... of one epoch (none: the worker is alive, nothing changed)."""

    epoch: str
    first: Annotated[int, msgspec.Meta(ge=1)]
    events: list[Event]


class KvSnapshot(msgspec.Struct, tag="snapshot", frozen=True, forbid_unknown_fields=True):
    """The state after event `seq` of `epoch`: each held block with its levels (a bit per level),
    the parent of each mapped block (b"" for a first block), the block each key names, and the
    mapped blocks not held yet, oldest first."""

    epoch: str
    seq: Annotated[int, msgspec.Meta(ge=0)]
    held: list[tuple[Digest, int]]
    parents: list[tuple[Digest, bytes]]
    keys: list[tuple[Digest, Digest]]
    unheld: list[Digest]


Frame = KvEvents | KvSnapshot

_ENCODER = msgspec.msgpack.Encoder()
_DECODER = msgspec.msgpack.Decoder(Frame)


def encode_frame(frame: Frame) -> bytes:
    """The frame behind its length."""
    body = _ENCODER.encode(frame)
    return len(body).to_bytes(4, "big") + body


def decode_frame(body: bytes | memoryview) -> Frame:
    """A frame's body (without its length); BadFrame for anything else."""
    try:
        return _DECODER.decode(body)
    except msgspec.DecodeError as error:
        raise BadFrame(f"undecodable KV event frame: {error}") from None


class FrameReader:
    """Cuts a byte stream into frames; BadFrame for a length past MAX_FRAME_BYTES."""

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, data: bytes) -> list[Frame]:
        self._buffer += data
        frames = []
        while len(self._buffer) >= 4:
            length = int.from_bytes(self._buffer[:4], "big")
            if length > MAX_FRAME_BYTES:
                raise BadFrame(f"a KV event frame of {length} bytes is past the {MAX_FRAME_BYTES} limit")
            if len(self._buffer) < 4 + length:
                break
            frames.append(decode_frame(bytes(self._buffer[4 : 4 + length])))
            del self._buffer[: 4 + length]
        return frames
