"""The messages between a pipeline's head and its stages (ZeroMQ, multipart: a pickled header, then
an optional tensor's raw bytes). Every stage reads one inbox, in order.

To a stage: Probe, Setup, Connect, Upstream, Step (activations of one micro-batch, or a replay),
SendReplay, Ping, Stop. To the head: Profiled, Ready, Logits, Replayed, Pong. A stage signs what
it sends the head with the `ident` its Setup gave it (a spare holds a stage's layers under its own
ident until it takes over).
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch
import zmq

from shoal.engine.model_runner import StepBatch
from shoal.parallel.stage_profile import NodeProfile

HEAD_IDENT = 0  # stage servers' idents start at 1


@dataclass(frozen=True)
class Probe:
    """Measure this node for the engine config (see stage_profile) and reply to `head`."""

    ident: int
    engine_config: dict
    head: str


@dataclass(frozen=True)
class Setup:
    """Load layers [first_layer, end_layer) with `num_blocks` KV blocks; send results to `downstream`
    (the next stage's inbox, or the head's; None for a spare) and replies to `head`; take steps
    from `upstream` only (a stage's ident, HEAD_IDENT; None for a spare)."""

    stage: int
    ident: int
    engine_config: dict
    first_layer: int
    end_layer: int
    num_blocks: int
    downstream: str | None
    upstream: int | None
    head: str
    wire_dtype: str


@dataclass(frozen=True)
class Connect:
    """From now on take steps from `upstream`, and send results to `downstream` unless None (a
    spare taking over; its downstream may be a replacement still to come)."""

    downstream: str | None
    upstream: int


@dataclass(frozen=True)
class Upstream:
    """From now on take steps from `upstream` only (the stage before this one was replaced)."""

    upstream: int


@dataclass(frozen=True)
class Step:
    """Hidden states entering this stage for `batch`, from the stage (or head) `sender`. A replay
    rebuilds the KV cache (and the boundary log) of a replacement stage: it is computed, not
    forwarded. A stage drops steps whose sender is not its upstream: a replaced stage that wakes
    up must not write stale slots."""

    step_id: int
    batch: StepBatch
    sender: int
    replay: bool = False
    stage_times: tuple[tuple[int, int, int], ...] = ()  # (stage, start ns, end ns) of the stages passed


@dataclass(frozen=True)
class SendReplay:
    """Connect downstream to `downstream` and replay the boundary log of these sequences (block
    table, tokens computed) to it, then tell it the replay is complete."""

    downstream: str
    sequences: list[tuple[list[int], int]]


@dataclass(frozen=True)
class ReplayDone:
    """Sent by `sender` after a replay's last step: the receiving stage acknowledges to the head
    (if the sender is its upstream)."""

    count: int
    sender: int


@dataclass(frozen=True)
class Ping:
    nonce: int


@dataclass(frozen=True)
class Stop:
    pass


@dataclass(frozen=True)
class Profiled:
    ident: int
    profile: NodeProfile


@dataclass(frozen=True)
class Ready:
    ident: int


@dataclass(frozen=True)
class Logits:
    """The logits of a micro-batch, and the compute times of the stages after the head."""

    step_id: int
    sender: int
    stage_times: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True)
class Replayed:
    ident: int
    count: int


@dataclass(frozen=True)
class Pong:
    """`busy_s`: the stage's seconds spent computing since it started (for the bubble fraction)."""

    ident: int
    nonce: int
    busy_s: float


def send(sock: zmq.Socket, header: object, tensor: torch.Tensor | None = None) -> int:
    """Sends one message; returns the bytes of its tensor (what the wire carries besides headers)."""
    frames = [pickle.dumps(header, protocol=pickle.HIGHEST_PROTOCOL)]
    if tensor is not None:
        tensor = tensor.contiguous()
        frames.append(pickle.dumps((tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))))
        frames.append(memoryview(tensor.view(torch.uint8).numpy()) if tensor.numel() else b"")
    sock.send_multipart(frames, copy=False)
    return tensor.numel() * tensor.element_size() if tensor is not None else 0


def receive(sock: zmq.Socket) -> tuple[object, torch.Tensor | None]:
    frames = sock.recv_multipart(copy=False)
    header = pickle.loads(frames[0].buffer)
    if len(frames) == 1:
        return header, None
    shape, dtype = pickle.loads(frames[1].buffer)
    raw = bytearray(frames[2].buffer)
    tensor = torch.frombuffer(raw, dtype=getattr(torch, dtype)) if raw else torch.empty(0, dtype=getattr(torch, dtype))
    return header, tensor.view(shape)
