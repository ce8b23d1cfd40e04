"""Embeddings: prompts run through the model (no token sampled), their final hidden states pooled.

A prompt runs in chunks of at most max_num_batched_tokens tokens on blocks taken from the free pool
for the call (each KV group a full-length table) and handed back uncached: the running requests'
blocks are untouched, and the free blocks taken lose what they cached, as any reuse does. Each
row's hidden states do not depend on the batch (the model's invariance), so a prompt's embedding
is the same whatever runs beside it or how it is cut.
"""

from __future__ import annotations

import torch

from shoal.runner.step_batch import StepBatch


def pool(hidden: torch.Tensor, pooling: str, normalize: bool) -> torch.Tensor:
    """One prompt's final hidden states [T, H] as one float32 vector [H]: the last token's, or the
    mean over the tokens; scaled to unit length with `normalize`."""
    rows = hidden.float()
    pooled = rows[-1] if pooling == "last" else rows.mean(dim=0)
    return torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled


def embed_prompts(engine, prompts: list[list[int]], pooling: str, normalize: bool) -> list[torch.Tensor]:
    """Each prompt's embedding (`pool` of its final hidden states). Runs on the engine thread
    between steps; ValueError when the free blocks cannot hold the longest prompt."""
    manager, runner = engine.block_manager, engine.runner
    budget = engine.config.max_num_batched_tokens
    embeddings = []
    for prompt in prompts:
        blocks = manager.blocks_needed(len(prompt))
        taken = manager.reserve_free(blocks * manager.groups.count)
        try:
            tables = [[taken[g * blocks : (g + 1) * blocks]] for g in range(manager.groups.count)]
            hidden = []
            for start in range(0, len(prompt), budget):
                ids = prompt[start : start + budget]
                positions = list(range(start, start + len(ids)))
                batch = StepBatch(ids, positions, [len(ids)], [start], tables, [])
                hidden.append(runner.run_layers(batch, torch.tensor(ids, device=engine.model.device)))
            embeddings.append(pool(engine.model.final_norm(torch.cat(hidden)), pooling, normalize))
        finally:
            manager.release_reserved(taken, [])
    return embeddings
