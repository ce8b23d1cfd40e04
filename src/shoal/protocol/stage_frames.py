"""The messages between a pipeline's head and its stages: one msgspec Struct each, tagged by class
name, sent as an Envelope header frame followed, for Step and Logits only, by one raw tensor frame.

To a stage (ToStage): Probe, Setup, Connect, Upstream, Step (activations of one micro-batch, or a
replay), SendReplay, ReplayDone, Ping, Stop. To the head (ToHead): Profiled, Ready, Logits,
Replayed, Pong. A stage signs what it sends the head with the `ident` its Setup gave it (a spare
holds a stage's layers under its own ident until it takes over). Engine configs travel as the
JSON the engine config itself writes and reads (EngineConfig.to_json / from_json).
"""

from __future__ import annotations

from typing import Annotated, ClassVar, Generic, TypeVar

import msgspec

from shoal.protocol.frames import BadFrame, TensorSpec, decode_header
from shoal.protocol.step_batch import Count, StepBatchFrame

HEAD_IDENT = 0  # stage servers' idents start at 1

StageTime = tuple[int, int, int]  # (stage, start ns, end ns)


class StageFrame(msgspec.Struct, frozen=True, tag=True, forbid_unknown_fields=True):
    """A header of the stage protocol. `carries_tensor`: whether one tensor frame follows it."""

    carries_tensor: ClassVar[bool] = False


class NodeProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a pipeline node can do (see parallel.stage_profile): seconds_per_layer, the median time
    of one decoder layer on the reference batch; free_bytes, the device's free memory before the
    stage loads anything; host and device, where it was measured (nodes on one host and device
    share its memory)."""

    seconds_per_layer: Annotated[float, msgspec.Meta(ge=0)]
    free_bytes: Count
    host: str
    device: str

    @property
    def location(self) -> tuple[str, str]:
        return self.host, self.device


class Probe(StageFrame):
    """Measure this node for the engine config (see stage_profile) and reply to `head`."""

    ident: int
    engine_config: str
    head: str


class Setup(StageFrame):
    """Load layers [first_layer, end_layer) with `num_blocks` KV blocks; send results to `downstream`
    (the next stage's inbox, or the head's; None for a spare) and replies to `head`; take steps
    from `upstream` only (a stage's ident, HEAD_IDENT; None for a spare)."""

    stage: Annotated[int, msgspec.Meta(ge=1)]
    ident: int
    engine_config: str
    first_layer: Count
    end_layer: Count
    num_blocks: Annotated[int, msgspec.Meta(ge=1)]
    downstream: str | None
    upstream: int | None
    head: str
    wire_dtype: str


class Connect(StageFrame):
    """From now on take steps from `upstream`, and send results to `downstream` unless None (a
    spare taking over; its downstream may be a replacement still to come)."""

    downstream: str | None
    upstream: int


class Upstream(StageFrame):
    """From now on take steps from `upstream` only (the stage before this one was replaced)."""

    upstream: int


class Step(StageFrame):
    """Hidden states (the tensor frame) entering this stage for `batch`, from the stage (or head)
    `sender`. A replay rebuilds the KV cache (and the boundary log) of a replacement stage: it is
    computed, not forwarded. A stage drops steps whose sender is not its upstream: a replaced
    stage that wakes up must not write stale slots."""

    carries_tensor: ClassVar[bool] = True

    step_id: int
    batch: StepBatchFrame
    sender: int
    replay: bool = False
    stage_times: tuple[StageTime, ...] = ()  # of the stages passed


class SendReplay(StageFrame):
    """Connect downstream to `downstream` and replay the boundary log of these sequences (block
    table, tokens computed) to it, then tell it the replay is complete."""

    downstream: str
    sequences: list[tuple[list[Count], Count]]


class ReplayDone(StageFrame):
    """Sent by `sender` after a replay's last step: the receiving stage acknowledges to the head
    (if the sender is its upstream)."""

    count: Count
    sender: int


class Ping(StageFrame):
    nonce: int


class Stop(StageFrame):
    pass


class Profiled(StageFrame):
    ident: int
    profile: NodeProfile


class Ready(StageFrame):
    ident: int


class Logits(StageFrame):
    """The logits of a micro-batch (the tensor frame), and the compute times of the stages after the head."""

    carries_tensor: ClassVar[bool] = True

    step_id: int
    sender: int
    stage_times: tuple[StageTime, ...] = ()


class Replayed(StageFrame):
    ident: int
    count: Count


class Pong(StageFrame):
    """`busy_s`: the stage's seconds spent computing since it started (for the bubble fraction)."""

    ident: int
    nonce: int
    busy_s: float


ToStage = Probe | Setup | Connect | Upstream | Step | SendReplay | ReplayDone | Ping | Stop
ToHead = Profiled | Ready | Logits | Replayed | Pong
Message = TypeVar("Message")


class Envelope(msgspec.Struct, Generic[Message], frozen=True, forbid_unknown_fields=True):
    """The header frame: the message, and the spec of the tensor frame after it (if it has one)."""

    message: Message
    tensor: TensorSpec | None = None


STAGE_INBOX = msgspec.msgpack.Decoder(Envelope[ToStage])
HEAD_INBOX = msgspec.msgpack.Decoder(Envelope[ToHead])
ENCODER = msgspec.msgpack.Encoder()


def encode(message: StageFrame, tensor: TensorSpec | None = None) -> bytes:
    return ENCODER.encode(Envelope(message, tensor))


def decode(decoder: msgspec.msgpack.Decoder, frames: list[bytes | memoryview]) -> tuple[StageFrame, TensorSpec | None]:
    """The message in a multipart message and the checked spec of its tensor frame (frames[1]).
    BadFrame unless the header matches the inbox's schema and the frames are exactly what it says."""
    if not frames:
        raise BadFrame("empty message")
    envelope = decode_header(decoder, frames[0])
    message, spec = envelope.message, envelope.tensor
    if message.carries_tensor != (spec is not None):
        raise BadFrame(f"{type(message).__name__} {'needs a' if message.carries_tensor else 'takes no'} tensor")
    if len(frames) != 1 + (spec is not None):
        raise BadFrame(f"{type(message).__name__} came in {len(frames)} frames, not {1 + (spec is not None)}")
    if spec is not None:
        spec.check(len(frames[1]))
    return message, spec
