"""KV blocks moved between two engines of the tiny model (issue 19's first piece): the receiver's
prefix cache knows the imported blocks, computes none of their tokens again, and answers token for
token as the sender, also when the blocks cross the wire as frames; a block layout that does not
match, and frames that are not what their header says, are refused before anything changes, and
an import cut short leaves no block owned by nobody."""

from __future__ import annotations

import asyncio
import pickle
from pathlib import Path

import msgspec
import pytest
import zmq

from shoal.engine.async_engine import AsyncLLMEngine
from shoal.engine.kv_layout import KVLayoutMismatch
from shoal.engine.kv_transfer import KVRefusedError, from_frames, to_frames, to_shared_frames
from shoal.engine.sampling_params import SamplingParams
from shoal.parallel.cluster_sockets import ClusterContext
from shoal.protocol import kv_frames
from shoal.protocol.frames import BadFrame
from shoal.worker.kv_peer import KVPeer, fetch_kv
from shoal.worker.metrics import WorkerMetrics
from tests.support.engine_runs import run_to_completion

PROMPT = list(range(5, 5 + 41))  # 10 full blocks of 4, and one token more
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=12, ignore_eos=True)


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_imported_blocks_spare_the_prompt_and_change_no_token(make_tiny_engine, params):
    sender, receiver = make_tiny_engine(), make_tiny_engine()
    expected = run_to_completion(sender, {"a": (PROMPT, params)})["a"]
    exported = sender.export_kv(PROMPT + expected)
    assert exported.num_tokens == 52 and len(exported.keys) == len(sender.model.layers)  # 52 of 53 cached
    assert receiver.import_kv(exported) == 13
    receiver.check_integrity()
    receiver.reset_counters()
    assert run_to_completion(receiver, {"b": (PROMPT, params)})["b"] == expected
    assert receiver.prompt_tokens_computed == 1  # the prompt's last token: its logits are needed
    assert receiver.import_kv(exported) == 0  # all cached already


def test_a_layout_that_does_not_match_is_refused_and_changes_nothing(make_tiny_engine):
    sender = make_tiny_engine()
    run_to_completion(sender, {"a": (PROMPT, GREEDY)})
    exported = sender.export_kv(PROMPT)
    for other in (make_tiny_engine(block_size=8), make_tiny_engine(dtype="bfloat16")):
        free = other.block_manager.num_free_blocks
        with pytest.raises(KVLayoutMismatch) as refused:
            other.import_kv(exported)
        assert ("block_size" in str(refused.value)) or ("dtype" in str(refused.value))
        assert other.block_manager.num_free_blocks == free and not other.block_manager.hash_index
        other.check_integrity()


def test_an_import_cut_short_leaves_every_block_free_and_uncached(make_tiny_engine):
    sender, receiver = make_tiny_engine(), make_tiny_engine()
    run_to_completion(sender, {"a": (PROMPT, GREEDY)})
    exported = sender.export_kv(PROMPT)
    exported.values = exported.values[:-1]  # the last layer's values never arrived
    free = receiver.block_manager.num_free_blocks
    with pytest.raises(ValueError):
        receiver.import_kv(exported)
    assert receiver.block_manager.num_free_blocks == free and not receiver.block_manager.hash_index
    receiver.check_integrity()
    tampered = sender.export_kv(PROMPT)
    tampered.token_ids[0] += 1  # hashes that do not chain over the tokens
    with pytest.raises(ValueError, match="does not match its tokens"):
        receiver.import_kv(tampered)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_blocks_cross_the_wire_as_frames_and_still_spare_the_prompt(make_tiny_engine, dtype):
    sender, receiver = make_tiny_engine(dtype=dtype), make_tiny_engine(dtype=dtype)
    expected = run_to_completion(sender, {"a": (PROMPT, SEEDED)})["a"]
    frames = [bytes(frame) for frame in to_frames(sender.export_kv(PROMPT))]  # as a socket delivers them
    assert len(frames) == 1 + 2 * len(sender.model.layers)
    assert receiver.import_kv(from_frames(frames)) == 10
    receiver.reset_counters()
    assert run_to_completion(receiver, {"b": (PROMPT, SEEDED)})["b"] == expected
    assert receiver.prompt_tokens_computed == 1


def test_on_one_host_the_blocks_go_through_shared_memory_that_the_receiver_unlinks(make_tiny_engine):
    sender, receiver = make_tiny_engine(), make_tiny_engine()
    expected = run_to_completion(sender, {"a": (PROMPT, SEEDED)})["a"]
    frames, segment = to_shared_frames(sender.export_kv(PROMPT))
    assert len(frames) == 1 and Path("/dev/shm", segment).exists()  # the header alone on the socket
    assert receiver.import_kv(from_frames([bytes(frames[0])])) == 10
    assert not Path("/dev/shm", segment).exists()
    receiver.reset_counters()
    assert run_to_completion(receiver, {"b": (PROMPT, SEEDED)})["b"] == expected
    assert receiver.prompt_tokens_computed == 1
    with pytest.raises(BadFrame, match="is gone"):  # read twice: the segment was unlinked
        from_frames([bytes(frames[0])])
    header = msgspec.msgpack.decode(frames[0])
    for name in ("../../etc/passwd", "psm_other"):  # only segments the peers name themselves
        with pytest.raises(BadFrame):
            from_frames([msgspec.msgpack.encode({**header, "shared_memory": name})])


def test_frames_that_are_not_what_their_header_says_are_refused(make_tiny_engine):
    sender = make_tiny_engine()
    run_to_completion(sender, {"a": (PROMPT, GREEDY)})
    frames = [bytes(frame) for frame in to_frames(sender.export_kv(PROMPT))]
    header = msgspec.msgpack.decode(frames[0])
    wrong_shape = {**header, "tensors": [{**header["tensors"][0], "shape": [1, 1, 1, 1]}, *header["tensors"][1:]]}
    cases = {
        "a frame missing": frames[:-1],
        "a buffer cut short": [*frames[:-1], frames[-1][:-4]],
        "a shape the layout does not give": [msgspec.msgpack.encode(wrong_shape), *frames[1:]],
        "an unknown field": [msgspec.msgpack.encode({**header, "extra": 1}), *frames[1:]],
        "a pickle": [pickle.dumps(header), *frames[1:]],
        "a dtype not on the wire": [
            msgspec.msgpack.encode({**header, "layout": {**header["layout"], "dtype": "float64"}}),
            *frames[1:],
        ],
    }
    for case, message in cases.items():
        with pytest.raises(BadFrame):
            from_frames(message)
            pytest.fail(f"{case} was accepted")


def test_serving_engines_move_blocks_between_steps_and_count_them_in_their_metrics(make_tiny_engine):
    async def scenario() -> tuple[bytes, bytes]:
        sender, receiver = AsyncLLMEngine(make_tiny_engine), AsyncLLMEngine(lambda: make_tiny_engine(block_size=4))
        mismatched = AsyncLLMEngine(lambda: make_tiny_engine(block_size=8))
        try:
            [*_, sent] = [out async for out in sender.generate(PROMPT, GREEDY)]
            exported = await sender.export_kv(PROMPT)
            assert await receiver.import_kv(exported) == 10
            with pytest.raises(KVLayoutMismatch, match="block_size"):  # the caller gets the engine's refusal
                await mismatched.import_kv(exported)
            [*_, received] = [out async for out in receiver.generate(PROMPT, GREEDY)]
            assert received.outputs[0].token_ids == sent.outputs[0].token_ids
            await asyncio.sleep(0.6)  # the stats snapshot follows the engine thread's next turn
            return WorkerMetrics(sender, "m").render(), WorkerMetrics(receiver, "m").render()
        finally:
            for engine in (sender, receiver, mismatched):
                engine.shutdown()

    out, into = asyncio.run(scenario())
    assert b'shoal:kv_transfer_blocks_total{direction="out",model_name="m"} 10.0' in out
    assert b'shoal:kv_transfer_blocks_total{direction="in",model_name="m"} 10.0' in into


def test_workers_fetch_blocks_from_each_others_kv_peer_only_with_the_cluster_secret(make_tiny_engine):
    async def scenario():
        loop = asyncio.get_running_loop()
        sender, receiver = AsyncLLMEngine(make_tiny_engine), AsyncLLMEngine(make_tiny_engine)
        members, stranger = ClusterContext("kv-secret"), ClusterContext("another-secret")
        peer = KVPeer(sender, members, "127.0.0.1", loop)
        try:
            [*_, sent] = [out async for out in sender.generate(PROMPT, GREEDY)]
            fetched = await asyncio.to_thread(fetch_kv, members, peer.address, PROMPT, 30)
            assert await receiver.import_kv(fetched) == 10
            receiver.engine.reset_counters()
            [*_, received] = [out async for out in receiver.generate(PROMPT, GREEDY)]
            assert received.outputs[0].token_ids == sent.outputs[0].token_ids
            assert receiver.engine.prompt_tokens_computed == 1
            with pytest.raises(TimeoutError):  # its handshake never completes
                await asyncio.to_thread(fetch_kv, stranger, peer.address, PROMPT, 2)
            garbage = members.connect(zmq.DEALER, peer.address)
            garbage.send(pickle.dumps({"token_ids": PROMPT}))
            assert garbage.poll(30_000)
            with pytest.raises(KVRefusedError, match="bad request"):
                from_frames(garbage.recv_multipart())
            garbage.close(linger=0)
            remote = members.connect(zmq.DEALER, peer.address)  # a requester on another host: frames
            remote.send(kv_frames.encode(kv_frames.KVWanted(PROMPT, host="another-host")))
            assert await asyncio.to_thread(remote.poll, 30_000)  # the peer exports on this loop
            answer = remote.recv_multipart()
            assert len(answer) == 1 + 2 * len(sender.engine.model.layers) and len(from_frames(answer).hashes) == 10
            remote.close(linger=0)
            unknown = await asyncio.to_thread(fetch_kv, members, peer.address, [9] * 20, 30)
            assert unknown.hashes == [] and unknown.keys[0].shape[0] == 0  # nothing cached: no block
        finally:
            peer.close()
            for engine in (sender, receiver):
                engine.shutdown()

    asyncio.run(scenario())
