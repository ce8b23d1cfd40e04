"""KV events: the state a router keeps from an engine's events equals what the engine's prefix
cache and KV tier really hold, after random traffic with evictions to the host and disk levels,
for a router that followed from the start, one that joined late, one that missed numbers, and
after the engine restarts (a new epoch, its disk level kept)."""

from __future__ import annotations

import random

from shoal.engine.kv_event_log import KvEventLog
from shoal.engine.sampling_params import SamplingParams
from shoal.protocol.kv_events import DEVICE, DISK, HOST, KvEvents, KvSnapshot
from shoal.protocol.kv_state import KvState
from tests.support.engine_runs import run_to_completion

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
TIER = {"kv_cache_bytes": 48 << 10, "kv_tier_host_bytes": 96 << 10, "kv_tier_disk_bytes": 256 << 10}


def real_levels(engine) -> dict[bytes, int]:
    """Each block hash the engine can serve a prefix from, with the levels that hold it."""
    levels: dict[bytes, int] = {}
    for digest in engine.block_manager.hash_index:
        levels[digest] = levels.get(digest, 0) | DEVICE
    for digest in engine.kv_tier.host:
        levels[digest] = levels.get(digest, 0) | HOST
    for digest in engine.kv_tier.disk.index:
        levels[digest] = levels.get(digest, 0) | DISK
    return levels


class Follower:
    """A router's view of one engine: applies what the log hands it, asks for a snapshot when told
    it missed events or met another epoch."""

    def __init__(self) -> None:
        self.state, self.epoch, self.seq, self.snapshots = KvState(), "", -1, 0

    def catch_up(self, log: KvEventLog) -> None:
        frame = log.read(self.seq) if self.epoch == log.epoch and self.seq >= 0 else None
        if frame is None:
            frame = log.snapshot()
        if isinstance(frame, KvSnapshot):
            self.state, self.epoch, self.seq = KvState.from_snapshot(frame), frame.epoch, frame.seq
            self.snapshots += 1
            return
        assert isinstance(frame, KvEvents) and frame.first == self.seq + 1
        for event in frame.events:
            self.state.apply(event)
        self.seq += len(frame.events)


def random_traffic(engine, rng: random.Random, rounds: int, followers: list[Follower]) -> None:
    """Prompts from a few shared heads with random tails, in small batches; after each batch every
    follower catches up and must equal the engine."""
    heads = [[rng.randrange(1, 120) for _ in range(rng.choice((8, 12, 20)))] for _ in range(4)]
    for round_ in range(rounds):
        batch = {}
        for i in range(rng.randint(1, 3)):
            prompt = rng.choice(heads) + [rng.randrange(1, 120) for _ in range(rng.randint(1, 24))]
            batch[f"r{round_}-{i}"] = (prompt, GREEDY)
        run_to_completion(engine, batch)
        truth = real_levels(engine)
        assert engine.kv_events.state.levels == truth
        for follower in followers:
            follower.catch_up(engine.kv_events)
            assert follower.state.levels == truth
            assert follower.state.same_as(engine.kv_events.state)


def test_followers_equal_the_engine_after_evictions_late_joins_missed_numbers_and_a_restart(make_tiny_engine, tmp_path):
    engine = make_tiny_engine(**TIER, kv_tier_dir=str(tmp_path))
    # A short memory, so a follower that falls behind must take a snapshot.
    log = KvEventLog(retained=300)
    engine.block_manager.events = engine.kv_tier.events = engine.kv_events = log
    rng = random.Random(7)
    early = Follower()
    random_traffic(engine, rng, 12, [early])
    assert engine.kv_tier.evictions["host"] > 0 and engine.kv_tier.disk.index  # blocks went down to disk

    late = Follower()  # joins now: a snapshot, then events
    random_traffic(engine, rng, 6, [early, late])
    assert late.snapshots == 1

    behind = Follower()
    behind.catch_up(log)
    for burst in range(20):
        if log.read(behind.seq) is None:  # the events it missed are gone
            break
        prompts = {f"burst-{burst}-{i}": ([rng.randrange(1, 120) for _ in range(40)], GREEDY) for i in range(4)}
        run_to_completion(engine, prompts)
    assert log.read(behind.seq) is None
    behind.catch_up(log)
    assert behind.snapshots == 2 and behind.state.levels == real_levels(engine)

    engine.shutdown()
    restarted = make_tiny_engine(**TIER, kv_tier_dir=str(tmp_path))
    assert restarted.kv_events.epoch != log.epoch
    assert restarted.kv_events.state.levels == real_levels(restarted) != {}  # the disk level it kept
    random_traffic(restarted, rng, 5, [early, late])
    assert early.snapshots == 2  # its first, and one for the new epoch
    restarted.shutdown()


def test_an_engine_without_events_or_prefix_caching_publishes_none(make_tiny_engine):
    assert make_tiny_engine(kv_events=False).kv_events is None
    assert make_tiny_engine(enable_prefix_caching=False).kv_events is None
