"""The messages from a tensor-parallel group's rank 0 to each follower, in order: Begin once, then
one RunBatch per step (each after the Adapters naming the LoRA adapters it runs that the follower
was not yet told of), then Finish. One msgspec Struct each, tagged by class name; no tensors."""

from __future__ import annotations

from typing import Annotated

import msgspec

from shoal.protocol.frames import decode_header
from shoal.protocol.step_batch import StepBatchFrame


class GroupFrame(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """A header of the tensor-group protocol."""


class Begin(GroupFrame):
    """Allocate `num_blocks` KV blocks (rank 0's budget decides for all ranks)."""

    num_blocks: Annotated[int, msgspec.Meta(ge=1)]


class RunBatch(GroupFrame):
    """Run this rank's shard of the forward pass on `batch`."""

    batch: StepBatchFrame


class NamedAdapter(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A LoRA adapter by name: its files (a PEFT directory on this host) and their SHA-256."""

    name: Annotated[str, msgspec.Meta(min_length=1)]
    path: Annotated[str, msgspec.Meta(min_length=1)]
    sha256: Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]


class Adapters(GroupFrame):
    """LoRA adapters the next batches may run: read each from its path, checked against its SHA-256,
    when a batch first needs it (a name told again with other files replaces them)."""

    adapters: list[NamedAdapter]


class Finish(GroupFrame):
    """The group is shutting down: exit after the batch in hand."""


ToFollower = Begin | RunBatch | Adapters | Finish
FOLLOWER_INBOX = msgspec.msgpack.Decoder(ToFollower)
ENCODER = msgspec.msgpack.Encoder()


def encode(message: GroupFrame) -> bytes:
    return ENCODER.encode(message)


def decode(frame: bytes | memoryview) -> GroupFrame:
    """The message in one frame; BadFrame for anything that is not one of ToFollower."""
    return decode_header(FOLLOWER_INBOX, frame)
