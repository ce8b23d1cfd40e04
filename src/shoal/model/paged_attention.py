"""Causal attention over a paged KV cache whose result for a query is independent of the batch.

The cache of one layer is a pair of tensors [num_blocks, num_kv_heads, block_size, head_dim];
a sequence owns a list of blocks (its block table). Queries are cut into *row tiles* of a fixed
height (rows = token x query-head-in-group of one sequence) and keys into the sequence's blocks, so
every matrix multiply has one fixed shape. Softmax uses the exact row maximum and sums the
per-block partials in block order with a sequential scan; blocks past a query's position add exact
zeros. Hence a query's output is bit-identical whether it is decoded alone, prefilled among other
tokens (chunked or not), or batched with any other sequences.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Index tensors for one forward step (built by `build_attention_metadata`).

    slot_blocks, slot_offsets: [T] cache block and offset in it of each new token.
    tile_rows: [W, R] index of each tile row into the step's query rows (T * G); padding rows
        point at the extra zero row T * G.
    tile_positions: [W, R] absolute position of each tile row's token (0 for padding).
    tile_blocks: [W, B] block table of the tile's sequence, padded with block 0 (always masked).
    score_bias: [W, B, 1, R, block_size] 0 where a tile row may see a key, -inf elsewhere.
    real_rows: positions in the flattened [W * R] tile rows that hold real (non-padding) rows.
    """

    slot_blocks: torch.Tensor
    slot_offsets: torch.Tensor
    tile_rows: torch.Tensor
    tile_positions: torch.Tensor
    tile_blocks: torch.Tensor
    score_bias: torch.Tensor
    real_rows: torch.Tensor


def build_attention_metadata(
    query_lens: list[int],
    start_positions: list[int],
    block_tables: list[list[int]],
    block_size: int,
    queries_per_kv: int,
    tile_height: int,
    device: torch.device,
) -> AttentionMetadata:
    """Describes a step in which sequence i computes query_lens[i] tokens from start_positions[i]."""
    slot_blocks: list[int] = []
    slot_offsets: list[int] = []
    tile_rows: list[list[int]] = []
    tile_positions: list[list[int]] = []
    tile_tables: list[list[int]] = []
    total_rows = sum(query_lens) * queries_per_kv
    first_row = 0
    max_blocks = 0
    for length, start, table in zip(query_lens, start_positions, block_tables):
        for pos in range(start, start + length):
            slot_blocks.append(table[pos // block_size])
            slot_offsets.append(pos % block_size)
        needed_blocks = -(-(start + length) // block_size)
        max_blocks = max(max_blocks, needed_blocks)
        rows = length * queries_per_kv
        for tile_start in range(0, rows, tile_height):
            row_ids = list(range(first_row + tile_start, first_row + min(rows, tile_start + tile_height)))
            positions = [start + (r - first_row) // queries_per_kv for r in row_ids]
            padding = tile_height - len(row_ids)
            tile_rows.append(row_ids + [total_rows] * padding)
            tile_positions.append(positions + [0] * padding)
            tile_tables.append(table[:needed_blocks])
        first_row += rows
    padded_tables = [t + [0] * (max_blocks - len(t)) for t in tile_tables]

    def as_tensor(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    rows_t, positions_t, blocks_t = as_tensor(tile_rows), as_tensor(tile_positions), as_tensor(padded_tables)
    key_positions = torch.arange(max_blocks * block_size, device=device).view(1, max_blocks, 1, 1, block_size)
    visible = key_positions <= positions_t.view(-1, 1, 1, tile_height, 1)
    score_bias = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))
    real_rows = torch.nonzero(rows_t.view(-1) < total_rows).view(-1)
    return AttentionMetadata(as_tensor(slot_blocks), as_tensor(slot_offsets), rows_t, positions_t, blocks_t,
                             score_bias, real_rows)


def write_kv(cache: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor,
             meta: AttentionMetadata) -> None:
    """Stores new keys/values [T, Hkv, D] in their blocks."""
    k_cache, v_cache = cache
    k_cache[meta.slot_blocks, :, meta.slot_offsets] = k.to(k_cache.dtype)
    v_cache[meta.slot_blocks, :, meta.slot_offsets] = v.to(v_cache.dtype)


def paged_attention(q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q: [T, H, D] (already rotated). Returns [T, H * D] in q's dtype; math in float32.

    Shapes: W tiles of R rows, B blocks of bs keys. Batch dims are ordered (W, B, Hkv) so the
    gathered cache blocks feed the multiplies without being copied into another layout.
    """
    k_cache, v_cache = cache
    tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    group = heads // kv_heads
    # Query rows per kv head, ordered (token, head-in-group), plus one zero row for tile padding.
    rows = q.view(tokens, kv_heads, group, head_dim).transpose(0, 1).reshape(kv_heads, tokens * group, head_dim)
    rows = torch.cat([rows.float() * scale, rows.new_zeros(kv_heads, 1, head_dim, dtype=torch.float32)], dim=1)
    tiles = rows[:, meta.tile_rows].transpose(0, 1).unsqueeze(1)  # [W, 1, Hkv, R, D]
    keys = k_cache[meta.tile_blocks].float()  # [W, B, Hkv, bs, D]
    scores = torch.matmul(tiles, keys.transpose(-1, -2)).add_(meta.score_bias)  # [W, B, Hkv, R, bs]
    probs = scores.sub_(scores.amax(dim=(1, 4), keepdim=True)).exp_()
    denominators = probs.sum(-1).cumsum(1)[:, -1]  # [W, Hkv, R]
    values = v_cache[meta.tile_blocks].float()  # [W, B, Hkv, bs, D]
    numerators = torch.matmul(probs, values).cumsum(1)[:, -1]  # [W, Hkv, R, D]
    out_tiles = numerators.div_(denominators.unsqueeze(-1)).transpose(0, 1).reshape(kv_heads, -1, head_dim)
    out_rows = rows.new_empty(kv_heads, tokens * group + 1, head_dim)
    out_rows[:, meta.tile_rows.view(-1)[meta.real_rows]] = out_tiles[:, meta.real_rows]
    out = out_rows[:, :-1].view(kv_heads, tokens, group, head_dim).transpose(0, 1)
    return out.reshape(tokens, heads * head_dim).to(q.dtype)
