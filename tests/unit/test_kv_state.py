"""A followed worker's KV state: which leading prefix keys it holds every block for (a missing
ancestor ends the match; a block only below the device counts as the tier's), and a router's feed
that starts over on a gap in the numbers or a new epoch, and drops a state gone silent."""

from __future__ import annotations

from shoal.protocol.kv_events import DEVICE, HOST, BlocksRemoved, BlocksStored, KvEvents, PromptMapped
from shoal.protocol.kv_state import KvState
from shoal.router.fleet.followed_caches import STALE_S, FollowedCaches, WorkerFeed

CHAIN = [b"t0", b"t1", b"t2", b"t3"]
KEYS = [b"k0", b"k1", b"k2", b"k3", b"k4"]


def mapped_state() -> KvState:
    state = KvState()
    state.apply(PromptMapped(CHAIN, [b"k1", b"k2", b"k3", b"k4"], [1, 2, 3, 4]))  # k0 needs no block
    state.apply(BlocksStored(DEVICE, CHAIN))
    return state


def test_the_match_ends_where_a_block_of_the_chain_is_missing():
    state = mapped_state()
    assert state.matched(KEYS) == (5, 0)
    state.apply(BlocksRemoved(DEVICE, [b"t1"]))
    assert state.matched(KEYS) == (2, 0)  # k1 needs t0 only, k2..k4 t1 too
    state.apply(BlocksStored(HOST, [b"t1"]))
    assert state.matched(KEYS) == (5, 1)  # t1 comes back from the tier
    assert state.matched([b"k0", b"k1", b"x2", b"x3"]) == (2, 0)  # a prompt that parts after k1


def test_an_evicted_block_keeps_its_keys_until_pushed_out_of_the_unheld():
    state = KvState(max_unheld=4)
    state.apply(PromptMapped(CHAIN, KEYS[1:], [1, 2, 3, 4]))
    state.apply(BlocksStored(DEVICE, CHAIN))
    state.apply(BlocksRemoved(DEVICE, [b"t3"]))
    state.apply(BlocksStored(DEVICE, [b"t3"]))  # computed again
    assert state.matched(KEYS) == (5, 0)
    state.apply(BlocksRemoved(DEVICE, CHAIN))
    state.apply(PromptMapped([b"u0", b"u1"], [b"j1"], [2]))  # another prompt, announced
    assert list(state.unheld) == [b"t2", b"t3", b"u0", b"u1"]
    assert b"t0" not in state.parents and b"k1" not in state.key_block and state.key_block[b"k3"] == b"t2"
    assert KvState.from_snapshot(state.snapshot("e", 9)).same_as(state)


def test_a_feed_starts_over_on_a_gap_or_another_epoch_and_drops_a_silent_state():
    feed = WorkerFeed()
    assert feed.apply(mapped_state().snapshot("epoch-1", 10), 0.0)
    assert feed.apply(KvEvents("epoch-1", 11, [BlocksRemoved(DEVICE, [b"t3"])]), 0.0)
    assert feed.seq == 11 and feed.state.matched(KEYS) == (4, 0)
    assert not feed.apply(KvEvents("epoch-1", 13, []), 0.0)  # 12 is missing
    assert feed.state is None and feed.seq == -1
    assert feed.apply(mapped_state().snapshot("epoch-2", 3), 0.0)
    assert not feed.apply(KvEvents("epoch-3", 4, []), 0.0)
    assert feed.apply(mapped_state().snapshot("epoch-3", 0), 0.0)
    assert feed.fresh_state(feed.received + 1) is feed.state
    assert feed.fresh_state(feed.received + STALE_S) is None


def test_the_followed_caches_know_which_workers_name_each_key():
    caches = FollowedCaches()
    caches.feed("a").apply(mapped_state().snapshot("e", 1), 0.0)
    caches.feed("b").apply(KvState().snapshot("e", 1), 0.0)
    assert caches.holding((b"k0", b"k2")) == {"a"} and caches.holding((b"zz",)) == set()
    caches.feed("b").apply(KvEvents("e", 2, [PromptMapped([b"t0"], [b"k2"], [1])]), 0.0)
    assert caches.holding((b"k2",)) == {"a", "b"}
    assert not caches.feed("a").apply(KvEvents("e", 9, []), 0.0)  # a gap: a's state and keys are gone
    assert caches.holding((b"k1", b"k2")) == {"b"}
    caches.drop("b")
    assert caches.holding((b"k2",)) == set()
