"""The typed frames of the stage and tensor-group protocols: every message survives the wire, each
inbox accepts only its own messages, and batches and tensor specs that do not add up are refused."""

from __future__ import annotations

import msgspec
import pytest

from shoal.parallel.stage_messages import batch_frame, step_batch
from shoal.parallel.stage_profile import reference_batch
from shoal.protocol import tensor_group_frames
from shoal.protocol.cluster_secret import (
    SECRET_ENV,
    MissingClusterSecret,
    derived_key,
    required_secret,
    run_secret,
)
from shoal.protocol.frames import BadFrame, TensorSpec
from shoal.protocol.stage_frames import (
    HEAD_INBOX,
    STAGE_INBOX,
    Connect,
    Logits,
    NodeProfile,
    Ping,
    Pong,
    Probe,
    Profiled,
    Ready,
    ReplayDone,
    Replayed,
    SendReplay,
    Setup,
    Step,
    Stop,
    Upstream,
    decode,
    encode,
)
from shoal.protocol.step_batch import StepBatchFrame

BATCH = StepBatchFrame([5, 6, 7], [0, 1, 4], [2, 1], [0, 4], [[[0], [1, 2]]], [1, 2])
SPEC = TensorSpec((3, 64), "bfloat16")
TO_STAGE = [
    Probe(1, "{}", "tcp://h:1"),
    Setup(2, 3, "{}", 0, 4, 10, "tcp://d:2", 0, "tcp://h:1", "auto"),
    Connect(None, 2),
    Upstream(4),
    Step(9, BATCH, 0, replay=True, stage_times=((1, 2, 3),)),
    SendReplay("tcp://d:2", [([0, 1], 20)]),
    ReplayDone(3, 1),
    Ping(8),
    Stop(),
]
TO_HEAD = [
    Profiled(2, NodeProfile(0.001, 1 << 30, "host", "cpu")),
    Ready(2),
    Logits(9, 2, ((1, 2, 3),)),
    Replayed(2, 3),
    Pong(2, 8, 1.5),
]


def frames_of(message) -> list[bytes]:
    if message.carries_tensor:
        return [encode(message, SPEC), bytes(3 * 64 * 2)]
    return [encode(message)]


@pytest.mark.parametrize("inbox,messages,others", [(STAGE_INBOX, TO_STAGE, TO_HEAD), (HEAD_INBOX, TO_HEAD, TO_STAGE)])
def test_each_inbox_reads_its_messages_back_and_refuses_the_others(inbox, messages, others):
    for message in messages:
        assert decode(inbox, frames_of(message)) == (message, SPEC if message.carries_tensor else None)
    for message in others:
        with pytest.raises(BadFrame, match="undecodable header"):
            decode(inbox, frames_of(message))


def test_an_engine_batch_becomes_a_frame_and_back_unchanged():
    batch = reference_batch(block_size=16)
    frame = msgspec.msgpack.decode(msgspec.msgpack.encode(batch_frame(batch)), type=StepBatchFrame)
    frame.check(num_blocks=len(batch.block_tables[0]) * 4, block_size=16, groups=1)
    assert step_batch(frame) == batch


@pytest.mark.parametrize(
    "fields,reason",
    [
        ({"positions": [0, 1, 5]}, "do not run from its start"),
        ({"start_positions": [0]}, "start positions"),
        ({"input_ids": [5, 6]}, "input ids"),
        ({"query_lens": [2, 2]}, "query tokens"),
        ({"last_rows": [3]}, "last row"),
        ({"block_tables": [[[0], [1, 9]]]}, "block table"),  # block 9 of a cache of 4
        ({"block_tables": [[[0], []]]}, "block table"),  # position 4 needs a second block of 4 slots
        ({"block_tables": [[[0], [1, 2]], [[0], [1, 2]]]}, "2 KV groups"),  # a cache of one group
    ],
)
def test_batches_that_do_not_add_up_are_refused(fields, reason):
    BATCH.check(num_blocks=4, block_size=4, groups=1)
    with pytest.raises(BadFrame, match=reason):
        msgspec.structs.replace(BATCH, **fields).check(num_blocks=4, block_size=4, groups=1)


def test_tensor_specs_must_match_their_frame_and_the_dtype_list():
    SPEC.check(3 * 64 * 2)
    with pytest.raises(BadFrame, match="needs 384 bytes"):
        SPEC.check(3 * 64 * 2 - 1)
    with pytest.raises(BadFrame, match="not one of"):
        TensorSpec((3,), "object").check(3 * 8)
    for shape in ([-1, 2], [1, 1, 1, 1, 1]):
        with pytest.raises(msgspec.ValidationError):
            msgspec.msgpack.decode(msgspec.msgpack.encode({"shape": shape, "dtype": "float32"}), type=TensorSpec)


def test_frames_must_be_as_many_as_the_header_says():
    step, logits = Step(9, BATCH, 0), Logits(9, 2)
    with pytest.raises(BadFrame, match="needs a tensor"):
        decode(STAGE_INBOX, [encode(step)])
    with pytest.raises(BadFrame, match="takes no tensor"):
        decode(STAGE_INBOX, [encode(Ping(1), SPEC), b""])
    with pytest.raises(BadFrame, match="came in 1 frames"):
        decode(HEAD_INBOX, [encode(logits, SPEC)])
    with pytest.raises(BadFrame, match="empty"):
        decode(STAGE_INBOX, [])


def test_tensor_group_messages_read_back_and_nothing_else_does():
    for message in (tensor_group_frames.Begin(7), tensor_group_frames.RunBatch(BATCH), tensor_group_frames.Finish()):
        assert tensor_group_frames.decode(tensor_group_frames.encode(message)) == message
    for frame in (encode(Ping(1)), b"\x80\x04\x95", msgspec.msgpack.encode({"type": "Begin", "num_blocks": 0})):
        with pytest.raises(BadFrame):
            tensor_group_frames.decode(frame)


def test_the_cluster_secret_is_required_where_peers_are_not_children(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(MissingClusterSecret, match=f"a stage server needs the cluster secret in \\${SECRET_ENV}"):
        required_secret("a stage server")
    assert run_secret() != run_secret()  # drawn afresh for each run
    monkeypatch.setenv(SECRET_ENV, "configured")
    assert required_secret("a stage server") == run_secret() == "configured"
    assert derived_key("configured", "a") != derived_key("configured", "b") != derived_key("other", "b")
