"""What the processes of one router group tell each other (shoal.router.group.bus carries it).

Msgpack on a unix socket: one `Hello` first, then length-prefixed batches of events. Each event is
a tagged msgspec Struct; a frame that does not decode to these types is refused whole, and nothing
else is ever built from the bytes. Work figures are a member's own totals on a worker (not deltas),
so a lost or repeated event cannot make members drift apart.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from shoal.protocol.worker_load import WorkerLoad

Count = Annotated[int, msgspec.Meta(ge=0)]
# The longest frame a member accepts: a batch of a busy loop turn, with prefix blocks.
MAX_FRAME_BYTES = 16 << 20


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    """Opens a connection: who sends, and the group's token to prove it belongs."""

    member: Count
    token: bytes


class Joined(msgspec.Struct, frozen=True, tag="joined"):
    """A worker registered with the sender (or is known to it, on a reconnect)."""

    url: str
    models: list[str]
    load: WorkerLoad | None = None


class Beat(msgspec.Struct, frozen=True, tag="beat"):
    """A worker's heartbeat reached the sender."""

    worker_id: str
    load: WorkerLoad | None = None


class Left(msgspec.Struct, frozen=True, tag="left"):
    """An operator removed a worker through the sender."""

    worker_id: str


class Placed(msgspec.Struct, frozen=True, tag="placed"):
    """The sender placed a prompt on a worker: it will hold these prefix blocks."""

    worker_id: str
    blocks: list[bytes]
    capacity_blocks: Count


class Work(msgspec.Struct, frozen=True, tag="work"):
    """The sender's requests in flight on a worker now, and their outstanding tokens."""

    worker_id: str
    requests: Count
    prefill_tokens: Count
    decode_tokens: Count


class SlotFreed(msgspec.Struct, frozen=True, tag="freed"):
    """The sender released an admission slot of a model: requests queued elsewhere may take it."""

    model: str


Event = Joined | Beat | Left | Placed | Work | SlotFreed
HELLO_DECODER = msgspec.msgpack.Decoder(Hello)
BATCH_DECODER = msgspec.msgpack.Decoder(list[Event])
ENCODER = msgspec.msgpack.Encoder()
