"""Both attention kernels equal causal softmax attention (with or without a sliding window, with or
without soft-capped scores, with or without attention sinks), and a query's bits never depend on
batching."""

from __future__ import annotations

import functools

import pytest
import torch

from shoal.model.cpu_attention import row_paged_attention
from shoal.model.native_kernels import load_native_kernels
from shoal.model.paged_attention import (
    allocate_kv_cache,
    build_attention_metadata,
    tiled_paged_attention,
    write_kv,
)

BLOCK, KV_HEADS, GROUP, DIM = 4, 2, 3, 16
HEADS = KV_HEADS * GROUP


def kernels() -> list:
    compiled = load_native_kernels()
    assert compiled is not None, "the C++ attention kernel must build on the CI machine"
    return [
        pytest.param(tiled_paged_attention, True, id="tiles"),
        pytest.param(functools.partial(row_paged_attention, compiled), False, id="rows"),
    ]


def new_cache(num_blocks=32, dtype=torch.float32):
    return allocate_kv_cache(num_blocks, KV_HEADS, BLOCK, DIM, dtype, torch.device("cpu"))


# Each query head's attention-sink logit (gpt-oss), around the scores' own size.
SINKS = torch.linspace(-1.0, 2.0, HEADS)
# (window, score soft cap, sinks): no window; one that leaves some tokens of a 4-token task none of
# an early 16-key tile; one that starts inside a tile; caps of 1.5 (scores of random rows exceed
# it); sinks with and without a window.
SHAPES = [
    pytest.param(0, 0.0, None, id="full"),
    pytest.param(3, 0.0, None, id="window3"),
    pytest.param(7, 0.0, None, id="window7"),
    pytest.param(0, 1.5, None, id="capped"),
    pytest.param(7, 1.5, None, id="window7-capped"),
    pytest.param(0, 0.0, SINKS, id="sinks"),
    pytest.param(7, 0.0, SINKS, id="window7-sinks"),
]


def run(kernel, tiles, cache, chunks, window=0, softcap=0.0, sinks=None):
    """chunks: list of (q [L,H,D], k [L,Hkv,D], v, start, block table). Writes K/V, returns outputs."""
    [meta] = build_attention_metadata(
        [c[0].shape[0] for c in chunks],
        [c[3] for c in chunks],
        [[c[4] for c in chunks]],
        BLOCK,
        KV_HEADS,
        GROUP,
        8,
        torch.device("cpu"),
        windows=(window,),
        with_tiles=tiles,
    )
    write_kv(cache, torch.cat([c[1] for c in chunks]), torch.cat([c[2] for c in chunks]), meta)
    out = kernel(torch.cat([c[0] for c in chunks]), cache, meta, DIM**-0.5, window, softcap, sinks)
    return out.split([c[0].shape[0] for c in chunks])


def reference(q, k, v, window=0, softcap=0.0, sinks=None):
    """Causal attention of one sequence from position 0; with a window, keys more than window - 1
    before the query are hidden too (transformers' sliding-window mask); with a soft cap, scaled
    scores become softcap * tanh(score / softcap) (Gemma 2's); with sinks, each head's sink logit is
    one more column of the softmax, dropped after it (transformers' gpt-oss)."""
    k = k.repeat_interleave(GROUP, dim=1).transpose(0, 1)
    v = v.repeat_interleave(GROUP, dim=1).transpose(0, 1)
    query, key = torch.arange(q.shape[0]).view(-1, 1), torch.arange(k.shape[1]).view(1, -1)
    visible = (key <= query) & ((key > query - window) if window else True)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * DIM**-0.5
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        column = sinks.view(-1, 1, 1).expand(-1, q.shape[0], 1)
        out = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1] @ v
        return out.transpose(0, 1).reshape(q.shape[0], -1)
    out = scores.softmax(-1) @ v
    return out.transpose(0, 1).reshape(q.shape[0], -1)


def random_seq(length, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(length, HEADS, DIM, generator=g),
        torch.randn(length, KV_HEADS, DIM, generator=g),
        torch.randn(length, KV_HEADS, DIM, generator=g),
    )


@pytest.mark.parametrize("window,softcap,sinks", SHAPES)
@pytest.mark.parametrize("kernel,tiles", kernels())
def test_matches_causal_attention_for_several_sequences(kernel, tiles, window, softcap, sinks):
    cache = new_cache()
    a, b = random_seq(21, 0), random_seq(5, 1)
    chunks = [(*a, 0, [3, 7, 1, 9, 11, 12]), (*b, 0, [2, 5])]
    out_a, out_b = run(kernel, tiles, cache, chunks, window, softcap, sinks)
    torch.testing.assert_close(out_a, reference(*a, window, softcap, sinks))
    torch.testing.assert_close(out_b, reference(*b, window, softcap, sinks))


@pytest.mark.parametrize("window,softcap,sinks", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kernel,tiles", kernels())
def test_decode_chunked_and_batched_results_are_bitwise_equal(kernel, tiles, dtype, window, softcap, sinks):
    q, k, v = (t.to(dtype) for t in random_seq(21, 2))
    table = [4, 8, 15, 16, 23, 30]
    whole = run(kernel, tiles, new_cache(dtype=dtype), [(q, k, v, 0, table)], window, softcap, sinks)[0]

    cache = new_cache(dtype=dtype)
    parts = [run(kernel, tiles, cache, [(q[:9], k[:9], v[:9], 0, table)], window, softcap, sinks)[0]]
    other = tuple(t.to(dtype) for t in random_seq(30, 3))
    other_table = [0, 1, 2, 3, 5, 6, 7, 9]
    run(kernel, tiles, cache, [(*[t[:20] for t in other], 0, other_table)], window, softcap, sinks)
    for pos in range(9, 21):
        mine = (q[pos : pos + 1], k[pos : pos + 1], v[pos : pos + 1], pos, table)
        neighbour = (other[0][20:21], other[1][20:21], other[2][20:21], 20, other_table)
        batch = [neighbour, mine] if pos == 9 else [mine]
        parts.append(run(kernel, tiles, cache, batch, window, softcap, sinks)[-1])
    assert torch.equal(torch.cat(parts), whole)
