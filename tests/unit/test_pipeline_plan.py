"""Pipeline layouts from measured node profiles: speed decides the split, nodes on one host share
its memory, and every stage's KV blocks (and boundary log) fit its budget."""

from __future__ import annotations

import pytest

from shoal.model.config import LlamaConfig
from shoal.model.llama import kv_bytes_per_token_per_layer
from shoal.parallel.pipeline_plan import (
    layer_values,
    pipeline_kv_blocks,
    plan_stages,
    shared_free_bytes,
)
from shoal.parallel.stage_profile import NodeProfile, reference_batch

GiB = 2**30
CONFIG = LlamaConfig(
    vocab_size=1000,
    hidden_size=256,
    intermediate_size=1024,
    num_layers=24,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
    max_position_embeddings=512,
)


def profile(ms_per_layer: float, free_gib: float, host: str = "a", device: str = "cpu") -> NodeProfile:
    return NodeProfile(ms_per_layer / 1e3, int(free_gib * GiB), host, device)


def test_a_slower_node_gets_fewer_layers_and_the_lm_head_counts_on_the_last():
    fast, slow = profile(1.0, 64, "fast"), profile(3.0, 64, "slow")
    plan = plan_stages(CONFIG, [fast, slow], ["fast", "slow"], None, 2, 512)
    assert plan.layers_per_stage == [18, 6]  # 18 ms against 6 × 3 ms and the head's share
    even = plan_stages(CONFIG, [fast, fast], ["a", "b"], None, 2, 512)
    head_layers = CONFIG.vocab_size * CONFIG.hidden_size / layer_values(CONFIG)
    assert even.layers_per_stage == [12, 12] and even.stages[1].seconds == pytest.approx((12 + head_layers) * 1e-3)
    assert plan_stages(CONFIG, [fast, slow], ["fast", "slow"], (20, 4), 2, 512).layers_per_stage == [20, 4]


def test_nodes_on_one_host_and_device_share_its_free_memory():
    head, local, gpu = profile(1, 30, "h"), profile(1, 30, "h"), profile(1, 80, "h", "cuda:0")
    assert shared_free_bytes([head, local, gpu, profile(1, 8, "other")]) == [15 * GiB, 15 * GiB, 80 * GiB, 8 * GiB]


def test_every_stage_affords_the_blocks_and_senders_keep_a_log_row_per_token():
    nodes = [profile(1, 1), profile(1, 1, "b")]
    plan = plan_stages(CONFIG, nodes, ["a", "b"], (16, 8), 4, 512)
    blocks = pipeline_kv_blocks(CONFIG, plan, 1 << 20, 0.1, 16, 4, 2, 10**9)
    per_layer = kv_bytes_per_token_per_layer(CONFIG, 4)
    head_per_token = 16 * per_layer + CONFIG.hidden_size * 2  # the first stage holds more and logs what it sends
    assert blocks == (1 << 20) // (16 * head_per_token)
    tight = plan_stages(CONFIG, [profile(1, 1), profile(1, 0.05, "b")], ["a", "b"], (20, 4), 4, 512)
    assert pipeline_kv_blocks(CONFIG, tight, None, 0.5, 16, 4, 2, 10**9) < pipeline_kv_blocks(
        CONFIG, plan, None, 0.5, 16, 4, 2, 10**9
    )  # the small node's budget bounds every stage


def test_the_reference_batch_gives_each_sequence_its_own_blocks():
    batch = reference_batch(16)
    [tables] = batch.block_tables
    used = [block for table in tables for block in table]
    assert len(used) == len(set(used)) and sum(batch.query_lens) == len(batch.input_ids) == len(batch.positions)
    assert all(
        start + length <= len(table) * 16
        for start, length, table in zip(batch.start_positions, batch.query_lens, tables)
    )
