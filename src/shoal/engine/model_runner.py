"""Runs one scheduled step through the model: builds the flat batch, returns logits to sample from."""
from __future__ import annotations

import torch

from shoal.engine.scheduler import ScheduledChunk
from shoal.model.llama import LlamaModel
from shoal.model.paged_attention import build_attention_metadata


class ModelRunner:
    """Owns the model and its KV cache. Invariant: the cache has `num_blocks` blocks of `block_size`
    slots per layer, matching the BlockManager that hands them out."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int):
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Row tiles of attention hold whole query-head groups; their height is fixed per model.
        group = model.config.num_queries_per_kv
        self.attention_tile_height = max(8, -(-group // 8) * 8)
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)

    def execute(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Computes all chunks in one forward pass; returns float32 logits [n, vocab] for the chunks
        that complete their sequence, in order."""
        device = self.model.device
        input_ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        for chunk in chunks:
            input_ids.extend(chunk.seq.all_token_ids[chunk.start:chunk.start + chunk.length])
            positions.extend(range(chunk.start, chunk.start + chunk.length))
            if chunk.completes_sequence:
                last_rows.append(len(input_ids) - 1)
        meta = build_attention_metadata(
            query_lens=[c.length for c in chunks],
            start_positions=[c.start for c in chunks],
            block_tables=[c.seq.block_table for c in chunks],
            block_size=self.block_size,
            num_kv_heads=self.model.config.num_kv_heads,
            queries_per_kv=self.model.config.num_queries_per_kv,
            tile_height=self.attention_tile_height,
            device=device,
            with_tiles=self.model.attention_uses_tiles,
        )
        hidden = self.model.forward(torch.tensor(input_ids, device=device), torch.tensor(positions, device=device),
                                    self.kv_caches, meta)
        if not last_rows:
            return torch.empty(0, self.model.config.vocab_size)
        return self.model.compute_logits(hidden[torch.tensor(last_rows, device=device)]).cpu()
