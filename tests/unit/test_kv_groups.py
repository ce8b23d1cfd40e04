"""Layers grouped by attention kind for the paged KV cache, and the blocks a sequence holds in them."""

from __future__ import annotations

import pytest

from shoal.model.config import LlamaConfig
from shoal.model.kv_groups import MAX_GROUPS, KVGroups


def config(windows: list[int]) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=32,
        hidden_size=8,
        intermediate_size=8,
        num_layers=len(windows),
        num_heads=2,
        num_kv_heads=1,
        head_dim=4,
        attention_windows=windows,
    )


def gemma3(layers: int, window: int) -> list[int]:
    """Gemma 3's pattern: five local layers, then a global one."""
    return [0 if (i + 1) % 6 == 0 else window for i in range(layers)]


def test_gemma3_270m_has_one_full_group_and_five_windowed_ones_of_three_layers():
    groups = KVGroups.of(config(gemma3(18, 512)))
    assert groups.slots == 3
    assert groups.windows == (0, 512, 512, 512, 512, 512)
    assert groups.layers[0] == (5, 11, 17)
    assert sorted(layer for group in groups.layers for layer in group) == list(range(18))
    assert groups.place(11) == (0, 1) and groups.place(0) == (1, 0)


def test_alternating_windows_make_two_groups_and_plain_models_one():
    alternating = KVGroups.of(config([128 if i % 2 == 0 else 0 for i in range(24)]))
    assert alternating.windows == (0, 128) and alternating.slots == 12
    plain = KVGroups.of(config([0] * 5))
    assert plain == KVGroups.full(5) and not plain.windowed
    windowed = KVGroups.of(config([64] * 4))
    assert windowed.windows == (64,) and windowed.windowed


def test_a_lone_full_layer_does_not_make_dozens_of_groups():
    groups = KVGroups.of(config([0] + [32] * 47))
    assert groups.count <= MAX_GROUPS + 1
    assert all(len(layers) <= groups.slots for layers in groups.layers)


@pytest.mark.parametrize("window,block_size", [(512, 16), (21, 4), (1024, 16)])
def test_blocks_held_counts_the_window_only_in_windowed_groups(window, block_size):
    groups = KVGroups.of(config(gemma3(26, window)))
    for tokens in (1, window, window + 1, 3 * window + 5, 8192):
        table = -(-tokens // block_size)
        first = max(0, tokens - window) // block_size
        expected = sum(table if not w else table - first for w in groups.windows)
        assert groups.blocks_held(tokens, block_size) == expected
    assert groups.tokens_fitting(groups.blocks_held(8192, block_size), block_size, 1 << 20) >= 8192


def test_gemma3_at_8k_tokens_holds_at_most_a_third_of_full_length_kv():
    for layers, window in ((18, 512), (26, 512), (34, 1024)):  # Gemma 3 270M, 1B, 4B
        groups = KVGroups.of(config(gemma3(layers, window)))
        held = groups.blocks_held(8192, 16) * groups.slots  # in layer-blocks
        assert held <= layers * (8192 // 16) / 3
