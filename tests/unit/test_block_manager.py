"""BlockManager invariants under random workloads, and prefix-cache behaviour."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.engine.block_manager import BlockManager
from shoal.engine.sampling_params import SamplingParams
from shoal.engine.sequence import Sequence


def make_seq(request_id: str, tokens: list[int]) -> Sequence:
    return Sequence(request_id, list(tokens), SamplingParams(), seed=0)


def admit(bm: BlockManager, seq: Sequence) -> bool:
    seq.num_computed_tokens = bm.allocate_cached_prefix(seq)
    if not bm.append_slots(seq, seq.num_uncomputed_tokens):
        bm.free(seq)
        seq.num_computed_tokens = 0
        return False
    seq.num_computed_tokens = seq.num_tokens
    bm.commit_computed(seq)
    return True


def test_second_request_with_same_prefix_reuses_blocks():
    bm = BlockManager(num_blocks=16, block_size=4)
    first = make_seq("a", list(range(10)))
    assert admit(bm, first)
    second = make_seq("b", list(range(8)) + [99, 98, 97])
    assert admit(bm, second)
    assert second.block_table[:2] == first.block_table[:2]
    assert bm.ref_counts[first.block_table[0]] == 2
    bm.check_integrity([first, second])


def test_freed_blocks_stay_cached_until_reused():
    bm = BlockManager(num_blocks=8, block_size=4)
    first = make_seq("a", list(range(9)))
    assert admit(bm, first)
    bm.free(first)
    again = make_seq("b", list(range(9)))
    assert bm.allocate_cached_prefix(again) == 8
    bm.free(again)
    # Filling the whole cache with other tokens evicts the cached prefix.
    hog = make_seq("c", list(range(100, 131)))
    assert admit(bm, hog)
    bm.free(hog)
    late = make_seq("d", list(range(9)))
    assert bm.allocate_cached_prefix(late) == 0
    bm.check_integrity([late])


def test_fully_cached_prompt_still_computes_one_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    assert admit(bm, make_seq("a", list(range(8))))
    twin = make_seq("b", list(range(8)))
    assert bm.allocate_cached_prefix(twin) == 4


def test_append_fails_cleanly_when_out_of_blocks():
    bm = BlockManager(num_blocks=2, block_size=4)
    seq = make_seq("a", list(range(12)))
    bm.allocate_cached_prefix(seq)
    assert not bm.append_slots(seq, 12)
    assert seq.block_table == [] and bm.num_free_blocks == 2


def test_disabled_prefix_caching_never_shares():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = make_seq("a", list(range(9))), make_seq("b", list(range(9)))
    assert admit(bm, a) and admit(bm, b)
    assert not set(a.block_table) & set(b.block_table)


operations = st.lists(
    st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 5), st.integers(1, 12)), max_size=60
)


@settings(max_examples=150, deadline=None)
@given(operations)
def test_random_workloads_never_leak_or_double_own(ops):
    bm = BlockManager(num_blocks=12, block_size=4)
    live: dict[int, Sequence] = {}
    counter = 0
    for op, slot, size in ops:
        if op == "add" and slot not in live:
            counter += 1
            # A few shared prefixes so that the cache gets hits.
            seq = make_seq(f"r{counter}", [slot % 2] * 4 + list(range(size)))
            if admit(bm, seq):
                live[slot] = seq
        elif op == "grow" and slot in live:
            seq = live[slot]
            seq.output_token_ids.extend([7] * size)
            if bm.append_slots(seq, seq.num_uncomputed_tokens):
                seq.num_computed_tokens = seq.num_tokens
                bm.commit_computed(seq)
            else:
                bm.free(live.pop(slot))
        elif op == "free" and slot in live:
            bm.free(live.pop(slot))
        bm.check_integrity(list(live.values()))
    for seq in live.values():
        bm.free(seq)
    bm.check_integrity([])
    assert bm.num_free_blocks == bm.num_blocks
