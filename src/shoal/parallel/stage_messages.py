"""Sending and receiving the stage protocol (shoal.protocol.stage_frames) on ZeroMQ sockets: the
header frame, then the raw bytes of a Step's or Logits' tensor, built with torch.frombuffer only
after the header's spec has been checked against the frame. Step batches travel as
StepBatchFrame and become the engine's StepBatch again on arrival."""

from __future__ import annotations

import msgspec
import torch
import zmq

from shoal.protocol.frames import TensorSpec
from shoal.protocol.stage_frames import StageFrame, decode, encode
from shoal.protocol.step_batch import StepBatchFrame
from shoal.runner.step_batch import StepBatch


def batch_frame(batch: StepBatch) -> StepBatchFrame:
    return StepBatchFrame(**vars(batch))


def step_batch(frame: StepBatchFrame) -> StepBatch:
    return StepBatch(**msgspec.structs.asdict(frame))


def send(sock: zmq.Socket, message: StageFrame, tensor: torch.Tensor | None = None) -> int:
    """Sends one message; returns the bytes of its tensor (what the wire carries besides headers)."""
    if tensor is None:
        sock.send(encode(message), copy=False)
        return 0
    tensor = tensor.contiguous()
    spec = TensorSpec(tuple(tensor.shape), str(tensor.dtype).removeprefix("torch."))
    raw = memoryview(tensor.view(torch.uint8).numpy()) if tensor.numel() else b""
    sock.send_multipart([encode(message, spec), raw], copy=False)
    return tensor.numel() * tensor.element_size()


def receive(sock: zmq.Socket, decoder: msgspec.msgpack.Decoder) -> tuple[StageFrame, torch.Tensor | None]:
    """The next message for this inbox (decoder: stage_frames.STAGE_INBOX or HEAD_INBOX) and its
    tensor. Raises BadFrame, having consumed the message, if it is not a valid one."""
    frames = [frame.buffer for frame in sock.recv_multipart(copy=False)]
    message, spec = decode(decoder, frames)
    if spec is None:
        return message, None
    dtype = getattr(torch, spec.dtype)
    raw = bytearray(frames[1])
    tensor = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    return message, tensor.view(spec.shape)
