"""Logits of shoal's model next to a reference implementation's."""

from __future__ import annotations

import torch

from shoal import LLM


def forward_logits(llm: LLM, token_ids: list[int], lora=None) -> torch.Tensor:
    """Logits for every position of one prompt, through the model and KV cache of a fresh engine;
    `lora` (a model.lora_batch.LoraBatch) names the rows' adapters."""
    from shoal.model.paged_attention import build_attention_metadata

    engine = llm.engine
    runner = engine.runner
    blocks = list(range(-(-len(token_ids) // runner.block_size)))
    config = engine.model.config
    groups = engine.model.kv_groups
    meta = build_attention_metadata(
        [len(token_ids)],
        [0],
        [[[block * groups.count + group for block in blocks]] for group in range(groups.count)],
        runner.block_size,
        config.num_kv_heads,
        config.num_queries_per_kv,
        runner.attention_tile_height,
        engine.device,
        windows=groups.windows,
        with_tiles=engine.model.attention_uses_tiles,
    )
    hidden = engine.model.forward(torch.tensor(token_ids), torch.arange(len(token_ids)), runner.kv_caches, meta, lora)
    return engine.model.compute_logits(hidden)


def max_logit_difference(
    reference, model_dir, cache_dir, ids: list[int], attention_kernel: str = "auto", inspect=None, **options
) -> float:
    """Largest |shoal - transformers| logit over a prompt, for a tiny checkpoint directory;
    `inspect(llm)`, if given, is called on the loaded engine first; `options`: more engine settings."""
    llm = LLM(
        str(model_dir),
        dtype="float32",
        device="cpu",
        kv_cache_bytes=1 << 20,
        block_size=4,
        cache_dir=str(cache_dir),
        attention_kernel=attention_kernel,
        **options,
    )
    if inspect is not None:
        inspect(llm)
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    return (forward_logits(llm, ids) - expected).abs().max().item()
