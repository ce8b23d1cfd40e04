"""The KV tier below the paged cache: a prefix evicted from the paged cache is served from host
memory, and from disk after the engine (or its worker process) restarts; the computed-token
counters prove it, and the answers do not change."""

from __future__ import annotations

import signal

import httpx
import torch

from shoal.engine.kv_layout import KVLayout
from shoal.engine.kv_tier import DiskTier, SharedTierFiles
from shoal.engine.sampling_params import SamplingParams
from tests.support.engine_runs import run_to_completion
from tests.support.workers import MODEL, scrape, spawn_worker, tiny_worker_args, wait_ready

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPT = list(range(5, 5 + 41))  # 10 full blocks of 4, and one token more
OTHERS = [[(7 * i + 3 * j) % 120 + 1 for j in range(41)] for i in range(4)]  # enough to evict PROMPT


def fill_and_return(engine) -> tuple[list[int], int]:
    """Runs PROMPT, then other prompts that evict it from the 23-block paged cache, then PROMPT
    again: its second answer and how many tokens that second run computed."""
    first = run_to_completion(engine, {"first": (PROMPT, GREEDY)})["first"]
    for i, other in enumerate(OTHERS):
        run_to_completion(engine, {f"other-{i}": (other, GREEDY)})
    computed = engine.prompt_tokens_computed
    again = run_to_completion(engine, {"again": (PROMPT, GREEDY)})["again"]
    assert again == first
    return again, engine.prompt_tokens_computed - computed


def test_an_evicted_prefix_comes_back_from_host_memory_then_from_disk_after_a_restart(make_tiny_engine, tmp_path):
    tier = {"kv_cache_bytes": 48 << 10, "kv_tier_host_bytes": 1 << 20, "kv_tier_disk_bytes": 4 << 20}
    engine = make_tiny_engine(**tier, kv_tier_dir=str(tmp_path))
    assert engine.block_manager.num_blocks < 4 * 11  # the other prompts do not all fit: PROMPT is evicted
    engine.reset_counters()
    answer, computed = fill_and_return(engine)
    stats = engine.stats().kv_tier
    assert computed == 1 and stats.hits["host"] == 10 and stats.hits["disk"] == 0  # only the last token
    engine.block_manager.check_integrity([])
    engine.shutdown()  # the host level goes down to disk

    restarted = make_tiny_engine(**tier, kv_tier_dir=str(tmp_path))
    restarted.reset_counters()
    assert run_to_completion(restarted, {"after": (PROMPT, GREEDY)})["after"] == answer
    stats = restarted.stats().kv_tier
    assert restarted.prompt_tokens_computed == 1 and stats.hits == {"host": 0, "disk": 10, "shared": 0}
    restarted.block_manager.check_integrity([])
    restarted.shutdown()


def test_without_a_tier_the_evicted_prefix_is_computed_again(make_tiny_engine):
    engine = make_tiny_engine(kv_cache_bytes=48 << 10)
    _, computed = fill_and_return(engine)
    assert computed == len(PROMPT) and engine.stats().kv_tier is None


def test_a_host_level_too_small_spills_its_oldest_blocks_to_disk(make_tiny_engine, tmp_path):
    engine = make_tiny_engine(
        kv_cache_bytes=48 << 10, kv_tier_host_bytes=1, kv_tier_disk_bytes=4 << 20, kv_tier_dir=str(tmp_path)
    )
    _, computed = fill_and_return(engine)
    stats = engine.stats().kv_tier
    assert computed == 1 and stats.hits["disk"] == 10 and stats.blocks["host"] == 0
    engine.shutdown()


LAYOUT = KVLayout("m", "float32", 4, 2, 1, 2, 8)


def test_disk_files_are_one_per_engine_survive_a_reopen_and_skip_a_slot_left_half_written(tmp_path):
    first, second = DiskTier(tmp_path, LAYOUT, 64, 64 * 8), DiskTier(tmp_path, LAYOUT, 64, 64 * 8)
    assert first.path != second.path  # each holds its own file's lock
    blocks = {bytes([i]) * 16: torch.full((64,), i, dtype=torch.uint8) for i in range(1, 4)}
    for digest, data in blocks.items():
        first.put(digest, data)
    torn = first.index[bytes([3]) * 16]
    first._digest_view(torn)[:] = bytes(16)  # as a crash in the middle of rewriting that slot leaves it
    first.close()
    second.close()
    reopened = DiskTier(tmp_path, LAYOUT, 64, 64 * 8)
    assert reopened.path == first.path
    assert set(reopened.index) == {bytes([1]) * 16, bytes([2]) * 16}
    assert torch.equal(reopened.get(bytes([2]) * 16), blocks[bytes([2]) * 16])
    reopened.close()
    other_layout = DiskTier(tmp_path, KVLayout("m", "bfloat16", 4, 2, 1, 2, 8), 32, 32 * 8)
    assert other_layout.path == first.path and not other_layout.index  # another layout starts afresh
    other_layout.close()


def test_a_worker_serves_an_evicted_prefix_from_its_tier_and_from_disk_after_a_restart(
    tiny_model_dir, shoal_cache_dir, tmp_path
):
    args = tiny_worker_args(
        tiny_model_dir,
        MODEL,
        "--block-size",
        "4",
        "--kv-tier-host-bytes",
        str(1 << 20),
        "--kv-tier-disk-bytes",
        str(4 << 20),
        "--kv-tier-dir",
        str(tmp_path),
        kv_cache="48KiB",
    )

    def complete(url: str, prompt: list[int]) -> list[int]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
        return httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]["token_ids"]

    def computed(url: str) -> float:
        return scrape(url)["shoal:prompt_tokens_computed_total"]

    process, url = wait_ready(*spawn_worker(args, shoal_cache_dir))
    first = complete(url, PROMPT)
    for other in OTHERS:
        complete(url, other)
    before = computed(url)
    assert complete(url, PROMPT) == first and computed(url) - before == 1
    assert scrape(url)["shoal:kv_tier_hits_total[('level', 'host')]"] == 10
    process.send_signal(signal.SIGTERM)  # a graceful restart keeps the host level on disk
    assert process.wait(timeout=60) == 0

    process, url = wait_ready(*spawn_worker(args, shoal_cache_dir))
    try:
        before = computed(url)
        assert complete(url, PROMPT) == first and computed(url) - before == 1
        assert scrape(url)["shoal:kv_tier_hits_total[('level', 'disk')]"] == 10
    finally:
        process.kill()
        process.wait(timeout=30)


def test_engines_sharing_a_tier_directory_read_each_others_blocks(make_tiny_engine, tmp_path):
    """Two workers of a host: a prefix one of them computed and evicted to its disk tier is found
    by the other, which has never seen it (computing only the last token)."""
    tier = {"kv_cache_bytes": 48 << 10, "kv_tier_disk_bytes": 4 << 20, "kv_tier_dir": str(tmp_path)}
    first, second = make_tiny_engine(**tier, kv_tier_shared=True), make_tiny_engine(**tier, kv_tier_shared=True)
    answer, _ = fill_and_return(first)  # PROMPT went down to first's tier file
    for i, other in enumerate(OTHERS):  # and out of its paged cache again
        run_to_completion(first, {f"again-{i}": (other, GREEDY)})
    second.reset_counters()
    assert run_to_completion(second, {"b": (PROMPT, GREEDY)})["b"] == answer
    stats = second.stats().kv_tier
    assert second.prompt_tokens_computed == 1 and stats.hits["shared"] == 10 and stats.hits["disk"] == 0
    second.block_manager.check_integrity([])
    unshared = make_tiny_engine(**tier)  # the default: its own file only
    unshared.reset_counters()
    run_to_completion(unshared, {"c": (PROMPT, GREEDY)})
    assert unshared.prompt_tokens_computed == len(PROMPT)
    for engine in (first, second, unshared):
        engine.shutdown()


def test_a_shared_slot_rewritten_while_it_is_read_is_a_miss_not_a_torn_block(tmp_path):
    writer = DiskTier(tmp_path, LAYOUT, 64, 64 * 8)
    digest = bytes([7]) * 16
    writer.put(digest, torch.full((64,), 7, dtype=torch.uint8))
    reader = SharedTierFiles(tmp_path, tmp_path / "elsewhere.kv", LAYOUT, 64)
    assert torch.equal(reader.get(digest), torch.full((64,), 7, dtype=torch.uint8))
    writer._digest_view(writer.index[digest])[:] = bytes(16)  # the owner is rewriting that slot
    assert reader.get(digest) is None and digest not in reader.index
    reader.close()
    writer.close()
