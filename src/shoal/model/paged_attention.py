"""Causal attention over a paged KV cache whose result for a query is independent of the batch.

The cache of one layer is a pair of tensors [num_blocks, block_size, num_kv_heads, head_dim];
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

    slot_mapping: [T] flat cache slot (block * block_size + offset) of each new token.
    tile_rows: [W, R] index of each tile row into the step's query rows (T * G); padding rows
        point at the extra zero row T * G.
    tile_positions: [W, R] absolute position of each tile row's token (0 for padding).
    tile_blocks: [W, B] block table of the tile's sequence, padded with block 0 (always masked).
    """

    slot_mapping: torch.Tensor
    tile_rows: torch.Tensor
    tile_positions: torch.Tensor
    tile_blocks: torch.Tensor


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
    slots: list[int] = []
    tile_rows: list[list[int]] = []
    tile_positions: list[list[int]] = []
    tile_tables: list[list[int]] = []
    total_rows = sum(query_lens) * queries_per_kv
    first_row = 0
    max_blocks = 0
    for length, start, table in zip(query_lens, start_positions, block_tables):
        for pos in range(start, start + length):
            slots.append(table[pos // block_size] * block_size + pos % block_size)
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

    return AttentionMetadata(as_tensor(slots), as_tensor(tile_rows), as_tensor(tile_positions), as_tensor(padded_tables))


def write_kv(cache: tuple[torch.Tensor, torch.Tensor], k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Stores new keys/values [T, Hkv, D] at their flat slots."""
    k_cache, v_cache = cache
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def paged_attention(q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata,
                    scale: float) -> torch.Tensor:
    """q: [T, H, D] (already rotated). Returns [T, H * D] in q's dtype; math in float32."""
    k_cache, v_cache = cache
    tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[2]
    group = heads // kv_heads
    block_size = k_cache.shape[1]
    # Query rows per kv head, ordered (token, head-in-group), plus one zero row for tile padding.
    rows = (q.float() * scale).view(tokens, kv_heads, group, head_dim).transpose(0, 1).reshape(kv_heads, tokens * group, head_dim)
    rows = torch.cat([rows, rows.new_zeros(kv_heads, 1, head_dim)], dim=1)
    tiles = rows[:, meta.tile_rows].permute(1, 0, 2, 3).unsqueeze(2)  # [W, Hkv, 1, R, D]
    keys = k_cache[meta.tile_blocks].float().permute(0, 3, 1, 4, 2)  # [W, Hkv, B, D, bs]
    scores = torch.matmul(tiles, keys)  # [W, Hkv, B, R, bs]
    num_blocks = meta.tile_blocks.shape[1]
    key_pos = torch.arange(num_blocks * block_size, device=q.device).view(num_blocks, 1, block_size)
    visible = key_pos.unsqueeze(0) <= meta.tile_positions.view(-1, 1, meta.tile_positions.shape[1], 1)
    scores = scores.masked_fill(~visible.unsqueeze(1), float("-inf"))
    row_max = scores.amax(dim=(2, 4), keepdim=True)
    probs = (scores - row_max).exp()
    denominators = probs.sum(-1).cumsum(2)[:, :, -1]  # [W, Hkv, R]
    values = v_cache[meta.tile_blocks].float().permute(0, 3, 1, 2, 4)  # [W, Hkv, B, bs, D]
    numerators = torch.matmul(probs, values).cumsum(2)[:, :, -1]  # [W, Hkv, R, D]
    out_tiles = numerators / denominators.unsqueeze(-1)
    out_rows = rows.new_empty(kv_heads, tokens * group + 1, head_dim)
    flat_rows = meta.tile_rows.reshape(-1)
    real = flat_rows < tokens * group
    out_rows[:, flat_rows[real]] = out_tiles.permute(1, 0, 2, 3).reshape(kv_heads, -1, head_dim)[:, real]
    out = out_rows[:, :-1].view(kv_heads, tokens, group, head_dim).transpose(0, 1)
    return out.reshape(tokens, heads * head_dim).to(q.dtype)
