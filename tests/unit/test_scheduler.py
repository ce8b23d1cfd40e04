"""Scheduler: token budget, chunked prefill, admission limits and preemption by recompute."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.engine.block_manager import BlockManager
from shoal.engine.sampling_params import SamplingParams
from shoal.engine.scheduler import Scheduler
from shoal.engine.sequence import Sequence, SequenceStatus


def make_seq(request_id: str, length: int) -> Sequence:
    return Sequence(
        request_id, list(range(1000 * len(request_id), 1000 * len(request_id) + length)), SamplingParams(), seed=0
    )


def complete(chunks) -> None:
    """Pretend the model ran: advance computed tokens and sample a token for finished chunks."""
    for chunk in chunks:
        chunk.seq.num_computed_tokens += chunk.length
        if chunk.completes_sequence:
            chunk.seq.output_token_ids.append(1)


def check(scheduler: Scheduler) -> None:
    ids = [s.request_id for s in scheduler.waiting] + [s.request_id for s in scheduler.running]
    assert len(ids) == len(set(ids))
    assert all(not s.block_tables for s in scheduler.waiting)
    assert all(s.status is SequenceStatus.RUNNING for s in scheduler.running)
    scheduler.block_manager.check_integrity(scheduler.running)


def test_long_prompt_is_prefilled_in_chunks_under_the_budget():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=10)
    seq = make_seq("a", 25)
    scheduler.add(seq)
    lengths = []
    while not seq.output_token_ids:
        chunks = scheduler.schedule()
        assert sum(c.length for c in chunks) <= 10
        lengths.append(chunks[0].length)
        complete(chunks)
        check(scheduler)
    assert lengths == [10, 10, 5]


def test_decodes_are_scheduled_before_new_prefills():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    first = make_seq("a", 6)
    scheduler.add(first)
    complete(scheduler.schedule())
    scheduler.add(make_seq("bb", 20))
    chunks = scheduler.schedule()
    assert chunks[0].seq is first and chunks[0].length == 1
    assert chunks[1].length == 7


def test_admission_respects_seq_limit():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=100)
    for name in ("a", "bb", "ccc"):
        scheduler.add(make_seq(name, 3))
    assert len(scheduler.schedule(seq_limit=2)) == 2
    assert len(scheduler.waiting) == 1


def test_out_of_blocks_preempts_newest_and_it_resumes_with_its_output():
    scheduler = Scheduler(BlockManager(6, 4), max_num_seqs=8, max_num_batched_tokens=100)
    old, new = make_seq("a", 8), make_seq("bb", 8)
    scheduler.add(old)
    scheduler.add(new)
    complete(scheduler.schedule())
    for _ in range(8):
        chunks = scheduler.schedule()
        complete(chunks)
        check(scheduler)
    assert scheduler.num_preemptions >= 1
    assert new.num_preemptions >= 1 and old.num_preemptions == 0
    # After the old one finishes, the preempted one comes back with prompt + its output.
    scheduler.finish(old, "stop")
    chunks = scheduler.schedule()
    assert chunks[0].seq is new and chunks[0].completes_sequence
    assert new.num_tokens > 8 and chunks[0].start + chunks[0].length == new.num_tokens


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 30), st.integers(0, 3)), min_size=1, max_size=12),
    st.integers(6, 20),
    st.integers(4, 40),
)
def test_random_traffic_keeps_invariants(requests, num_blocks, budget):
    scheduler = Scheduler(BlockManager(num_blocks, 4), max_num_seqs=4, max_num_batched_tokens=budget)
    seqs = []
    for i, (length, _) in enumerate(requests):
        length = min(length, num_blocks * 4 - 8)
        seq = make_seq("r" * (i + 1), max(length, 1))
        seqs.append(seq)
        scheduler.add(seq)
    for _ in range(400):
        if not scheduler.has_work():
            break
        chunks = scheduler.schedule()
        assert sum(c.length for c in chunks) <= budget
        complete(chunks)
        for seq, (_, extra) in zip(seqs, requests):
            if seq.status is SequenceStatus.RUNNING and len(seq.output_token_ids) > extra:
                scheduler.finish(seq, "length")
        check(scheduler)
    assert not scheduler.has_work()


def classed(request_id: str, length: int, scheduling: str) -> Sequence:
    seq = make_seq(request_id, length)
    seq.scheduling = scheduling
    return seq


def test_waiting_sequences_queue_by_class_then_arrival():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    for name, scheduling in [("b1", "background"), ("i1", "interactive"), ("p1", "probe")]:
        scheduler.add(classed(name, 4, scheduling))
    for name, scheduling in [("b2", "background"), ("i2", "interactive")]:
        scheduler.add(classed(name, 4, scheduling))
    assert [s.request_id for s in scheduler.waiting] == ["p1", "i1", "i2", "b1", "b2"]
    assert [c.seq.request_id for c in scheduler.schedule()] == ["p1", "i1"]


def test_background_sequences_sit_out_the_steps_in_which_an_interactive_one_prefills():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=8)
    background = [classed(name, 3, "background") for name in ("b1", "b2")]
    for seq in background:
        scheduler.add(seq)
    complete(scheduler.schedule())  # both prefilled: decoding from here
    decodes = scheduler.schedule()
    assert [c.seq.request_id for c in decodes] == ["b1", "b2"]
    complete(decodes)
    interactive = classed("i1", 12, "interactive")
    scheduler.add(interactive)
    steps = []
    while interactive.num_uncomputed_tokens > 1 or not steps:
        chunks = scheduler.schedule()
        steps.append([c.seq.request_id for c in chunks])
        complete(chunks)
        check(scheduler)
    assert steps == [["i1"], ["i1"]]  # its prefill, in chunks of its own
    assert [c.seq.request_id for c in scheduler.schedule()] == ["i1", "b1", "b2"]  # decodes together again
    assert [s.scheduling for s in scheduler.running] == ["background", "background", "interactive"]


def test_preemption_takes_a_background_sequence_first():
    scheduler = Scheduler(BlockManager(6, 4), max_num_seqs=8, max_num_batched_tokens=64)
    interactive, background = classed("i1", 8, "interactive"), classed("b1", 8, "background")
    scheduler.add(background)
    complete(scheduler.schedule())
    scheduler.add(interactive)
    complete(scheduler.schedule())
    while not scheduler.waiting:  # both grow until the blocks run out
        complete(scheduler.schedule())
    assert [s.request_id for s in scheduler.waiting] == ["b1"] and scheduler.running == [interactive]


def test_an_interactive_sequence_takes_the_place_or_blocks_of_background_ones():
    full = Scheduler(BlockManager(64, 4), max_num_seqs=2, max_num_batched_tokens=64)
    for name in ("b1", "b2"):
        full.add(classed(name, 4, "background"))
    complete(full.schedule())
    full.add(classed("i1", 4, "interactive"))
    assert [c.seq.request_id for c in full.schedule()] == ["i1"]  # b2 gave its place
    assert [s.request_id for s in full.waiting] == ["b2"]
    tight = Scheduler(BlockManager(3, 4), max_num_seqs=8, max_num_batched_tokens=64)
    tight.add(classed("b1", 8, "background"))
    complete(tight.schedule())
    tight.add(classed("i1", 8, "interactive"))
    assert [c.seq.request_id for c in tight.schedule()] == ["i1"]  # b1 gave its blocks
    check(tight)


def test_background_work_computes_at_most_its_tokens_per_step():
    scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=8, max_num_batched_tokens=64, background_step_tokens=10)
    for name in ("b1", "b2"):
        scheduler.add(classed(name, 25, "background"))
    steps = []
    while any(not s.output_token_ids for s in scheduler.running + list(scheduler.waiting)):
        chunks = scheduler.schedule()
        steps.append(sum(c.length for c in chunks))
        complete(chunks)
        check(scheduler)
    assert max(steps) == 10 and len(steps) >= 5  # 50 prompt tokens, 10 a step
