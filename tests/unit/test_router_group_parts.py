"""The parts a router group shares state with: the slot table (real processes racing for slots),
the members' channel (real unix sockets: the token, typed events, snapshots on reconnect), and a
worker's view counting what the other members have in flight."""

from __future__ import annotations

import asyncio
import multiprocessing
from pathlib import Path

import msgspec
import pytest

from shoal.protocol.group_events import BATCH_DECODER, ENCODER, Hello, Placed, Work
from shoal.router.admission.slots import GroupSlots
from shoal.router.fleet.circuit_breaker import CircuitBreaker
from shoal.router.fleet.worker_state import WorkerState
from shoal.router.group.bus import GroupBus, _frame, socket_path


def _take_many(path: Path, member: int, attempts: int, capacity: int, taken) -> None:
    slots = GroupSlots(path, member, 4)
    taken[member] = sum(slots.try_take("model", capacity) for _ in range(attempts))


def test_processes_racing_for_slots_never_take_more_than_the_capacity(tmp_path):
    path = tmp_path / "slots"
    GroupSlots.create(path, 4)
    spawn = multiprocessing.get_context("spawn")
    taken = spawn.Manager().dict()
    racers = [spawn.Process(target=_take_many, args=(path, m, 400, 250, taken)) for m in range(4)]
    for racer in racers:
        racer.start()
    for racer in racers:
        racer.join(60)
    assert sum(taken.values()) == 250
    parent = GroupSlots(path, None, 4)
    assert parent.held("model") == 250 and parent.held("another") == 0
    parent.clear(2)
    assert parent.held("model") == 250 - taken[2]


def test_slots_are_per_model_and_given_back(tmp_path):
    GroupSlots.create(tmp_path / "slots", 2)
    a, b = GroupSlots(tmp_path / "slots", 0, 2), GroupSlots(tmp_path / "slots", 1, 2)
    assert a.try_take("x", 1) and not b.try_take("x", 1) and b.try_take("y", 1)
    a.give_back("x")
    assert b.try_take("x", 1) and a.total() == b.total() == 2


def test_unknown_events_are_refused_whole():
    with pytest.raises(msgspec.DecodeError):
        BATCH_DECODER.decode(ENCODER.encode([{"type": "exec", "code": "boom"}]))
    with pytest.raises(msgspec.ValidationError):
        BATCH_DECODER.decode(ENCODER.encode([{"type": "work", "worker_id": "w", "requests": -1}]))


def test_members_hear_each_other_and_strangers_are_cut_off(tmp_path):
    asyncio.run(_channel_scenario(tmp_path))


async def _channel_scenario(directory: Path) -> None:
    heard: dict[int, list] = {0: [], 1: []}
    gone: list[tuple[int, int]] = []

    def bus(member: int, snapshot) -> GroupBus:
        return GroupBus(
            directory,
            member,
            2,
            b"group-token",
            lambda sender, events: heard[member].extend((sender, e) for e in events),
            lambda sender: gone.append((member, sender)),
            snapshot,
        )

    first = bus(0, lambda: [Work(worker_id="w", requests=2, prefill_tokens=10, decode_tokens=5)])
    second = bus(1, lambda: [])
    await first.start()
    await second.start()
    await _until(lambda: heard[1] and first._writers and second._writers)
    assert heard[1] == [(0, Work(worker_id="w", requests=2, prefill_tokens=10, decode_tokens=5))]  # the snapshot

    first.publish(Placed(worker_id="w", blocks=[b"a", b"b"], capacity_blocks=8))
    first.publish(Work(worker_id="w", requests=1, prefill_tokens=0, decode_tokens=5))
    await _until(lambda: len(heard[1]) == 3)
    assert [e for _, e in heard[1][1:]] == [
        Placed(worker_id="w", blocks=[b"a", b"b"], capacity_blocks=8),
        Work(worker_id="w", requests=1, prefill_tokens=0, decode_tokens=5),
    ]

    # A stranger without the token: cut off, nothing it sends is applied.
    reader, writer = await asyncio.open_unix_connection(str(socket_path(directory, 1)))
    writer.write(_frame(ENCODER.encode(Hello(member=0, token=b"wrong"))))
    writer.write(_frame(ENCODER.encode([Work(worker_id="w", requests=9, prefill_tokens=9, decode_tokens=9)])))
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed by the member
    assert len(heard[1]) == 3

    # The first member restarts: what it said before is void, its snapshot comes again.
    await first.close()
    await _until(lambda: (1, 0) in gone)
    again = bus(0, lambda: [Work(worker_id="w", requests=1, prefill_tokens=1, decode_tokens=1)])
    await again.start()
    await _until(lambda: len(heard[1]) == 4)
    assert heard[1][3] == (0, Work(worker_id="w", requests=1, prefill_tokens=1, decode_tokens=1))
    await again.close()
    await second.close()


async def _until(condition, timeout_s: float = 10) -> None:
    async def poll():
        while not condition():
            await asyncio.sleep(0.02)

    await asyncio.wait_for(poll(), timeout_s)


def test_another_members_work_counts_in_the_workers_view_until_it_is_gone():
    changed = []
    state = WorkerState("w", "w", frozenset({"m"}), CircuitBreaker(5, 5.0, 60.0, lambda *_: None))
    state.work_changed = changed.append
    ticket = state.start(100, 20)
    state.set_elsewhere(1, 2, 300, 40)
    state.set_elsewhere(2, 1, 0, 10)
    view = state.view()
    assert (view.in_flight, view.outstanding_prefill_tokens, view.outstanding_decode_tokens) == (4, 400, 70)
    state.first_byte(ticket)
    state.set_elsewhere(1, 0, 0, 0)  # gone, or nothing left there
    view = state.view()
    assert (view.in_flight, view.outstanding_prefill_tokens, view.outstanding_decode_tokens) == (2, 0, 30)
    state.finish(ticket)
    assert changed == [state, state, state]  # each change of its own work is heard
