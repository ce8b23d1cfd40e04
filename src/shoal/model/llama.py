"""The Llama-family decoder (SmolLM2, TinyLlama, Llama 2/3, Qwen2, Mistral) over a paged KV cache.

Weights use Hugging Face names and layout and are referenced, not copied, so memory-mapped cache
files stay shared between processes. Every matrix multiply goes through `invariant_linear` and
attention through `paged_attention`, so a token's hidden states never depend on its batch.
"""
from __future__ import annotations

import torch
from torch import nn

from shoal.model.config import LlamaConfig
from shoal.model.invariant_linear import invariant_linear
from shoal.model.paged_attention import AttentionMetadata, paged_attention, write_kv
from shoal.model.rope import RotaryEmbedding

KVCache = tuple[torch.Tensor, torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: normalised in float32, scaled in the weight dtype (as transformers does)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(weight.dtype)


class DecoderLayer:
    """One attention + SwiGLU MLP block; holds references to its weights."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], prefix: str, tile_rows: int):
        self.config = config
        self.tile_rows = tile_rows
        attn = prefix + "self_attn."
        self.q = (weights[attn + "q_proj.weight"], weights.get(attn + "q_proj.bias"))
        self.k = (weights[attn + "k_proj.weight"], weights.get(attn + "k_proj.bias"))
        self.v = (weights[attn + "v_proj.weight"], weights.get(attn + "v_proj.bias"))
        self.o = (weights[attn + "o_proj.weight"], weights.get(attn + "o_proj.bias"))
        self.gate = weights[prefix + "mlp.gate_proj.weight"]
        self.up = weights[prefix + "mlp.up_proj.weight"]
        self.down = weights[prefix + "mlp.down_proj.weight"]
        self.input_norm = weights[prefix + "input_layernorm.weight"]
        self.post_attention_norm = weights[prefix + "post_attention_layernorm.weight"]
        self.scale = config.head_dim ** -0.5

    def _linear(self, x: torch.Tensor, weight_and_bias: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        return invariant_linear(x, weight_and_bias[0], weight_and_bias[1], self.tile_rows)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor, rope: RotaryEmbedding,
                cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.config
        tokens = hidden.shape[0]
        x = rms_norm(hidden, self.input_norm, cfg.rms_norm_eps)
        q = self._linear(x, self.q).view(tokens, cfg.num_heads, cfg.head_dim)
        k = self._linear(x, self.k).view(tokens, cfg.num_kv_heads, cfg.head_dim)
        v = self._linear(x, self.v).view(tokens, cfg.num_kv_heads, cfg.head_dim)
        q, k = rope(positions, q, k)
        write_kv(cache, k, v, meta.slot_mapping)
        hidden = hidden + self._linear(paged_attention(q, cache, meta, self.scale), self.o)
        x = rms_norm(hidden, self.post_attention_norm, cfg.rms_norm_eps)
        gate = invariant_linear(x, self.gate, None, self.tile_rows)
        up = invariant_linear(x, self.up, None, self.tile_rows)
        return hidden + invariant_linear(nn.functional.silu(gate) * up, self.down, None, self.tile_rows)


class LlamaModel:
    """Decoder stack + LM head. Invariant: weights are not modified; caches are owned by the caller."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], tile_rows: int,
                 device: torch.device | str = "cpu"):
        self.config = config
        self.tile_rows = tile_rows
        self.device = torch.device(device)
        weights = {name: t.to(self.device) for name, t in weights.items()}
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.embed = weights["model.embed_tokens.weight"]
        self.norm = weights["model.norm.weight"]
        self.lm_head = self.embed if config.tie_word_embeddings else weights["lm_head.weight"]
        self.layers = [DecoderLayer(config, weights, f"model.layers.{i}.", tile_rows) for i in range(config.num_layers)]
        self.rope = RotaryEmbedding(config).to(self.device)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]. Writes the tokens' K/V into `caches`; returns final hidden [T, H]."""
        hidden = self.embed[input_ids]
        for layer, cache in zip(self.layers, caches):
            hidden = layer.forward(hidden, positions, self.rope, cache, meta)
        return rms_norm(hidden, self.norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the given final hidden states."""
        return invariant_linear(hidden, self.lm_head, None, self.tile_rows).float()

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[KVCache]:
        """Zero-filled caches (zeros keep masked-out slots finite, so 0 * value stays 0)."""
        cfg = self.config
        shape = (num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        return [(torch.zeros(shape, dtype=self.dtype, device=self.device),
                 torch.zeros(shape, dtype=self.dtype, device=self.device)) for _ in range(cfg.num_layers)]

    def kv_bytes_per_token(self) -> int:
        cfg = self.config
        return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * self.embed.element_size()
