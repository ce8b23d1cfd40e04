"""How tensor parallelism splits a model: contiguous, as even as possible, uneven when it must be;
the output projections by their output rows."""

from __future__ import annotations

import pytest
import torch

from shoal.model.config import LlamaConfig
from shoal.model.sharding import TensorParallel, shard_weights


@pytest.mark.parametrize("count,size", [(3, 2), (49152, 2), (1536, 3), (7, 7), (5, 4)])
def test_ranks_split_a_count_into_contiguous_nearly_equal_ranges(count, size):
    ranges = [TensorParallel(rank, size, None).split(count) for rank in range(size)]
    assert ranges[0][0] == 0 and ranges[-1][1] == count
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    assert max(e - s for s, e in ranges) - min(e - s for s, e in ranges) <= 1


def smollm_like_weights(config: LlamaConfig) -> dict[str, torch.Tensor]:
    hidden, dim, inter = config.hidden_size, config.head_dim, config.intermediate_size
    prefix = "model.layers.0."
    return {
        "model.embed_tokens.weight": torch.randn(config.vocab_size, hidden),
        "model.norm.weight": torch.ones(hidden),
        prefix + "input_layernorm.weight": torch.ones(hidden),
        prefix + "post_attention_layernorm.weight": torch.ones(hidden),
        prefix + "self_attn.q_proj.weight": torch.randn(config.num_heads * dim, hidden),
        prefix + "self_attn.k_proj.weight": torch.randn(config.num_kv_heads * dim, hidden),
        prefix + "self_attn.v_proj.weight": torch.randn(config.num_kv_heads * dim, hidden),
        prefix + "self_attn.o_proj.weight": torch.randn(hidden, config.num_heads * dim),
        prefix + "self_attn.o_proj.bias": torch.randn(hidden),
        prefix + "mlp.gate_proj.weight": torch.randn(inter, hidden),
        prefix + "mlp.up_proj.weight": torch.randn(inter, hidden),
        prefix + "mlp.down_proj.weight": torch.randn(hidden, inter),
    }


def test_three_kv_heads_over_two_ranks_shard_into_whole_head_groups_and_reassemble():
    config = LlamaConfig(
        vocab_size=101,
        hidden_size=36,
        intermediate_size=30,
        num_layers=1,
        num_heads=9,
        num_kv_heads=3,
        head_dim=4,
        tie_word_embeddings=True,
    )
    weights = smollm_like_weights(config)
    shards = [shard_weights(config, weights, TensorParallel(rank, 2, None)) for rank in range(2)]
    assert [(c.num_kv_heads, c.num_heads, c.intermediate_size) for c, _ in shards] == [(2, 6, 15), (1, 3, 15)]
    prefix = "model.layers.0."
    for name, dim in [
        ("self_attn.q_proj.weight", 0),
        ("self_attn.k_proj.weight", 0),
        ("self_attn.o_proj.weight", 0),
        ("self_attn.o_proj.bias", 0),
        ("mlp.gate_proj.weight", 0),
        ("mlp.down_proj.weight", 0),
    ]:
        assert torch.equal(torch.cat([w[prefix + name] for _, w in shards], dim=dim), weights[prefix + name])
    assert torch.equal(
        torch.cat([w["model.embed_tokens.weight"] for _, w in shards]), weights["model.embed_tokens.weight"]
    )
    # The output projections keep every input column of the rows a rank holds.
    assert [w[prefix + "mlp.down_proj.weight"].shape for _, w in shards] == [(18, 30), (18, 30)]
    assert all(torch.equal(w["model.norm.weight"], weights["model.norm.weight"]) for _, w in shards)


def test_more_ranks_than_kv_heads_cannot_shard():
    config = LlamaConfig(
        vocab_size=10, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=2
    )
    with pytest.raises(ValueError, match="exceeds the model's 2 KV heads"):
        shard_weights(config, {}, TensorParallel(0, 3, None))
