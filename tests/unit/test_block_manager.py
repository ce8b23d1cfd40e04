"""BlockManager invariants under random workloads, and prefix-cache behaviour."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.engine.block_manager import BlockManager, group_key
from shoal.engine.sampling_params import SamplingParams
from shoal.engine.sequence import Sequence
from shoal.model.kv_groups import NULL_BLOCK, KVGroups

# A full-attention group and two groups whose layers see the last 6 tokens (blocks of 4).
HYBRID = KVGroups((0, 6, 6), ((0,), (1,), (2,)), 1)


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
    assert second.block_tables[0][:2] == first.block_tables[0][:2]
    assert bm.ref_counts[first.block_tables[0][0]] == 2
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
    assert seq.block_tables == [[]] and bm.num_free_blocks == 2


def test_disabled_prefix_caching_never_shares():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    a, b = make_seq("a", list(range(9))), make_seq("b", list(range(9)))
    assert admit(bm, a) and admit(bm, b)
    assert not set(a.block_tables[0]) & set(b.block_tables[0])


operations = st.lists(
    st.tuples(st.sampled_from(["add", "grow", "free"]), st.integers(0, 5), st.integers(1, 12)), max_size=60
)


def assert_reachable_blocks_held(bm: BlockManager, seq: Sequence) -> None:
    """Every block a query from the sequence's next token on may read is a real block (those below
    its reach are given back at its next append)."""
    for group, table in enumerate(seq.block_tables):
        first = bm.groups.first_needed_block(group, seq.num_computed_tokens, bm.block_size)
        assert NULL_BLOCK not in table[first:]


@pytest.mark.parametrize("groups", [None, HYBRID], ids=["one-group", "hybrid"])
@settings(max_examples=150, deadline=None)
@given(ops=operations)
def test_random_workloads_never_leak_or_double_own(groups, ops):
    bm = BlockManager(num_blocks=12 if groups is None else 30, block_size=4, groups=groups)
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
        if groups is not None:
            for seq in live.values():
                assert_reachable_blocks_held(bm, seq)
    for seq in live.values():
        bm.free(seq)
    bm.check_integrity([])
    assert bm.num_free_blocks == bm.num_usable_blocks


def test_windowed_groups_give_back_what_slid_out_of_reach():
    bm = BlockManager(num_blocks=40, block_size=4, groups=HYBRID)
    seq = make_seq("a", list(range(40)))
    assert admit(bm, seq)
    seq.output_token_ids.append(7)
    assert bm.append_slots(seq, 1)
    # For position 40, the full group holds 11 blocks; each windowed one those of positions 35-40.
    assert [sum(b != NULL_BLOCK for b in table) for table in seq.block_tables] == [11, 3, 3]
    assert bm.num_free_blocks == 39 - 17
    bm.check_integrity([seq])


def test_a_windowed_prefix_is_found_only_with_the_blocks_its_next_query_reaches():
    bm = BlockManager(num_blocks=40, block_size=4, groups=HYBRID)
    first = make_seq("a", list(range(40)))
    assert admit(bm, first)
    bm.free(first)
    again = make_seq("b", list(range(40)) + [99])
    again.num_computed_tokens = bm.allocate_cached_prefix(again)
    assert again.num_computed_tokens == 40
    assert_reachable_blocks_held(bm, again)
    bm.free(again)
    # A prompt that ends earlier needs window blocks the first sequence gave back mid-way: they stay
    # cached, so it is found too.
    shorter = make_seq("c", list(range(21)))
    shorter.num_computed_tokens = bm.allocate_cached_prefix(shorter)
    assert shorter.num_computed_tokens == 20
    assert_reachable_blocks_held(bm, shorter)
    bm.free(shorter)
    # Once the windowed groups' last blocks are gone, only a prefix whose reach they do not cover is.
    for group in (1, 2):
        bm.free_queue.move_to_end(bm.hash_index[group_key(bm.chain(list(range(40)), 10)[9], group)], last=False)
    bm.release_reserved(bm.reserve_free(2), [])  # evicted
    late = make_seq("d", list(range(40)) + [99])
    late.num_computed_tokens = bm.allocate_cached_prefix(late)
    assert late.num_computed_tokens == 36
    assert_reachable_blocks_held(bm, late)
    bm.check_integrity([late])
