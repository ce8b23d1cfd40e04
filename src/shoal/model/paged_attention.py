"""Causal attention over a paged KV cache whose result for a query is independent of the batch.

The cache of one layer is a key tensor [num_blocks, num_kv_heads, block_size, head_dim] and a
value tensor [num_blocks, num_kv_heads, block_size, head_dim + 1] whose last column is all ones,
so one multiply yields both the softmax numerator and its denominator. A sequence owns a list of
blocks (its block table). Queries are cut into *row tiles* of a fixed height (a row is one token x
one query head of a kv-head group, all from one sequence) and keys into the sequence's blocks, so
every matrix multiply has one fixed shape. Softmax uses the exact row maximum and sums the
per-block partials in block order with a sequential scan; blocks past a query's position add exact
zeros. Hence a query's output is bit-identical whether it is decoded alone, prefilled among other
tokens (chunked or not), or batched with any other sequences.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Index tensors for one forward step (built by `build_attention_metadata`).

    slot_rows: [T * Hkv] row of each new (token, kv head) in the caches viewed as [-1, D].
    block_tables: [S, B] block table of each sequence, padded with block 0; token_sequences and
        token_positions: [T] each token's sequence (row of block_tables) and absolute position.
    The tile fields below are built only for the tiled kernel (with_tiles=True):
    row_tokens, row_heads: [W, R] token index and head-in-group of each tile row; padding rows
        use token T (an extra zero query) and head 0.
    tile_blocks: [W, B] block table of the tile's sequence, padded with block 0 (always masked).
    score_bias: [W, B, 1, R, block_size] 0 where a tile row may see a key, -inf elsewhere.
    window, window_score_bias: the sliding window of the group the step was built for (0: none), and
        score_bias for it (keys more than window - 1 before the row's position hidden too).
    """

    slot_rows: torch.Tensor
    block_tables: torch.Tensor
    token_sequences: torch.Tensor
    token_positions: torch.Tensor
    row_tokens: torch.Tensor | None = None
    row_heads: torch.Tensor | None = None
    tile_blocks: torch.Tensor | None = None
    score_bias: torch.Tensor | None = None
    window: int = 0
    window_score_bias: torch.Tensor | None = None


def build_attention_metadata(
    query_lens: list[int],
    start_positions: list[int],
    block_tables: list[list[list[int]]],
    block_size: int,
    num_kv_heads: int,
    queries_per_kv: int,
    tile_height: int,
    device: torch.device,
    windows: tuple[int, ...],
    with_tiles: bool = True,
) -> list[AttentionMetadata]:
    """Describes a step in which sequence i computes query_lens[i] tokens from start_positions[i]:
    one metadata per KV group g (shoal.model.kv_groups), from its tables block_tables[g] and its
    sliding window windows[g] (0: none). Only the tables, and what is read from them, differ."""

    def as_tensor(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    token_sequences: list[int] = []
    token_positions: list[int] = []
    for index, (length, start) in enumerate(zip(query_lens, start_positions)):
        token_sequences.extend([index] * length)
        token_positions.extend(range(start, start + length))
    # Every table covers the blocks up to its sequence's last new token (windowed ones with
    # NULL_BLOCK below their reach), so all groups have the same width.
    visible = [-(-(start + length) // block_size) for length, start in zip(query_lens, start_positions)]
    width = max(visible)
    padded_tables = [[t[:v] + [0] * (width - v) for t, v in zip(tables, visible)] for tables in block_tables]
    metas = [
        AttentionMetadata(
            as_tensor(_slot_rows(query_lens, start_positions, tables, block_size, num_kv_heads)),
            as_tensor(tables),
            as_tensor(token_sequences),
            as_tensor(token_positions),
            window=window,
        )
        for tables, window in zip(padded_tables, windows, strict=True)
    ]
    if not with_tiles:
        return metas
    row_tokens: list[list[int]] = []
    row_heads: list[list[int]] = []
    row_positions: list[list[int]] = []
    tile_sequences: list[int] = []
    padding_token = sum(query_lens)
    first_token = 0
    for index, (length, start) in enumerate(zip(query_lens, start_positions)):
        rows = length * queries_per_kv
        for tile_start in range(0, rows, tile_height):
            tile = range(tile_start, min(rows, tile_start + tile_height))
            padding = tile_height - len(tile)
            row_tokens.append([first_token + r // queries_per_kv for r in tile] + [padding_token] * padding)
            row_heads.append([r % queries_per_kv for r in tile] + [0] * padding)
            row_positions.append([start + r // queries_per_kv for r in tile] + [0] * padding)
            tile_sequences.append(index)
        first_token += length
    key_positions = torch.arange(width * block_size, device=device).view(1, width, 1, 1, block_size)
    positions = as_tensor(row_positions).view(-1, 1, 1, tile_height, 1)
    seen = key_positions <= positions

    def bias(visible: torch.Tensor) -> torch.Tensor:
        return torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))

    tiles = {"row_tokens": as_tensor(row_tokens), "row_heads": as_tensor(row_heads), "score_bias": bias(seen)}
    window_biases = {w: bias(seen & (key_positions > positions - w)) for w in set(windows) if w}
    sequences = as_tensor(tile_sequences)
    return [
        dataclasses.replace(
            meta, tile_blocks=meta.block_tables[sequences], window_score_bias=window_biases.get(meta.window), **tiles
        )
        for meta in metas
    ]


def _slot_rows(
    query_lens: list[int], start_positions: list[int], tables: list[list[int]], block_size: int, num_kv_heads: int
) -> list[int]:
    """The row of each new (token, kv head) in a cache viewed as [-1, D], for one group's tables."""
    rows: list[int] = []
    for length, start, table in zip(query_lens, start_positions, tables):
        for pos in range(start, start + length):
            first_row = table[pos // block_size] * num_kv_heads * block_size + pos % block_size
            rows.extend(range(first_row, first_row + num_kv_heads * block_size, block_size))
    return rows


def allocate_kv_cache(
    num_blocks: int, num_kv_heads: int, block_size: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Zeroed keys and values (+ the ones column); zeros keep unwritten slots finite, so 0 * value = 0."""
    keys = torch.zeros(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)
    values = torch.zeros(num_blocks, num_kv_heads, block_size, head_dim + 1, dtype=dtype, device=device)
    values[..., head_dim] = 1
    return keys, values


def write_kv(
    cache: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Stores new keys/values [T, Hkv, D] in their blocks."""
    k_cache, v_cache = cache
    head_dim = k.shape[-1]
    k_cache.view(-1, head_dim).index_copy_(0, meta.slot_rows, k.reshape(-1, head_dim).to(k_cache.dtype))
    v_cache.view(-1, head_dim + 1)[:, :head_dim].index_copy_(
        0, meta.slot_rows, v.reshape(-1, head_dim).to(v_cache.dtype)
    )


def tiled_paged_attention(
    q: torch.Tensor,
    cache: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, H, D] (already rotated). Returns [T, H * D] in q's dtype; math in float32. `window`: the
    layer's sliding window (0: none), the one `meta` was built for; `softcap`: scaled scores become
    softcap * tanh(score / softcap) before the mask (0: none); `sinks`: each query head's
    attention-sink logit [H] (None: none), a term of the softmax's sum without a value.

    Shapes: W tiles of R rows, B blocks of bs keys. Batch dims are ordered (W, B, Hkv) so the
    gathered cache blocks feed the multiplies without being copied into another layout.
    """
    k_cache, v_cache = cache
    tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    grouped = torch.cat([q, q.new_zeros(1, heads, head_dim)]).view(tokens + 1, kv_heads, heads // kv_heads, head_dim)
    tiles = grouped[meta.row_tokens, :, meta.row_heads].float().transpose(1, 2).unsqueeze(1)  # [W, 1, Hkv, R, D]
    keys = k_cache[meta.tile_blocks].float()  # [W, B, Hkv, bs, D]
    if window and window != meta.window:
        raise ValueError(f"a layer with a window of {window} in a step built for {meta.window}")
    score_bias = meta.window_score_bias if window else meta.score_bias
    scores = torch.matmul(tiles, keys.transpose(-1, -2)).mul_(scale)  # [W, B, Hkv, R, bs]
    if softcap:
        scores = scores.div_(softcap).tanh_().mul_(softcap)
    scores = scores.add_(score_bias)
    maxima = scores.amax(dim=(1, 4), keepdim=True)  # [W, 1, Hkv, R, 1]
    probs = scores.sub_(maxima).exp_()
    values = v_cache[meta.tile_blocks].float()  # [W, B, Hkv, bs, D + 1]
    weighted = torch.matmul(probs, values).cumsum(1)[:, -1]  # [W, Hkv, R, D + 1]; last column: softmax sum
    total = weighted[..., head_dim:]
    if sinks is not None:
        row_sinks = sinks.float().view(kv_heads, heads // kv_heads)[:, meta.row_heads].permute(1, 0, 2)  # [W, Hkv, R]
        total = total + (row_sinks.unsqueeze(-1) - maxima[:, 0]).exp()
    out_tiles = (weighted[..., :head_dim] / total).transpose(1, 2)  # [W, R, Hkv, D]
    out = q.new_empty(tokens + 1, kv_heads, heads // kv_heads, head_dim, dtype=torch.float32)
    out[meta.row_tokens, :, meta.row_heads] = out_tiles
    return out[:tokens].view(tokens, heads * head_dim).to(q.dtype)
