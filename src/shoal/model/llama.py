"""The Llama-family decoder (SmolLM2, TinyLlama, Llama 2/3, Qwen2, Mistral) over a paged KV cache.

Weights use Hugging Face names and layout. Unless prepacked for the CPU's GEMM kernels they are
referenced, not copied, so memory-mapped cache files stay shared between processes. Every matrix
multiply goes through `InvariantLinear` and attention through one of two batch-invariant kernels
(the C++ row kernel on CPUs, the tiled torch kernel elsewhere), so a token's hidden states never
depend on its batch.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import nn

from shoal.model.config import LlamaConfig
from shoal.model.cpu_attention import load_cpu_attention, row_paged_attention
from shoal.model.invariant_linear import InvariantLinear
from shoal.model.paged_attention import AttentionMetadata, allocate_kv_cache, tiled_paged_attention, write_kv
from shoal.model.rope import RotaryEmbedding, apply_rotary

KVCache = tuple[torch.Tensor, torch.Tensor]
AttentionKernel = Callable[[torch.Tensor, KVCache, AttentionMetadata, float], torch.Tensor]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: normalised in float32, scaled in the weight dtype (as transformers does)."""
    return weight * torch.rms_norm(x.float(), x.shape[-1:], eps=eps).to(weight.dtype)


class DecoderLayer:
    """One attention + SwiGLU MLP block, with q/k/v and gate/up each fused into one projection."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], prefix: str, tile_rows: int,
                 prepack: bool, attention: AttentionKernel):
        self.config = config
        self.attention = attention
        attn = prefix + "self_attn."
        self.qkv = InvariantLinear([weights[f"{attn}{p}_proj.weight"] for p in "qkv"],
                                   [weights.get(f"{attn}{p}_proj.bias") for p in "qkv"], tile_rows, prepack)
        self.o = InvariantLinear([weights[attn + "o_proj.weight"]], [weights.get(attn + "o_proj.bias")], tile_rows,
                                 prepack)
        self.gate_up = InvariantLinear([weights[prefix + "mlp.gate_proj.weight"], weights[prefix + "mlp.up_proj.weight"]],
                                       None, tile_rows, prepack)
        self.down = InvariantLinear([weights[prefix + "mlp.down_proj.weight"]], None, tile_rows, prepack)
        self.input_norm = weights[prefix + "input_layernorm.weight"]
        self.post_attention_norm = weights[prefix + "post_attention_layernorm.weight"]
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim ** -0.5

    def forward(self, hidden: torch.Tensor, rope_tables: tuple[torch.Tensor, torch.Tensor],
                cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.config
        tokens = hidden.shape[0]
        qkv = self.qkv(rms_norm(hidden, self.input_norm, cfg.rms_norm_eps))
        # q and k are rotated together: one pass over the [T, H + Hkv, D] view.
        qk = apply_rotary(qkv[:, :self.q_size + self.kv_size].reshape(tokens, -1, cfg.head_dim), *rope_tables)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size:].reshape(tokens, cfg.num_kv_heads, cfg.head_dim)
        write_kv(cache, k, v, meta)
        hidden = hidden + self.o(self.attention(q, cache, meta, self.scale))
        gate, up = self.gate_up(rms_norm(hidden, self.post_attention_norm, cfg.rms_norm_eps)).chunk(2, dim=1)
        return hidden + self.down(nn.functional.silu(gate) * up)


class LlamaModel:
    """Decoder stack + LM head. Invariant: weights are not modified; caches are owned by the caller."""

    def __init__(self, config: LlamaConfig, weights: dict[str, torch.Tensor], tile_rows: int,
                 device: torch.device | str = "cpu", prepack: bool = False, attention_kernel: str = "auto"):
        self.config = config
        self.device = torch.device(device)
        weights = {name: t.to(self.device) for name, t in weights.items()}
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.embed = weights["model.embed_tokens.weight"]
        self.norm = weights["model.norm.weight"]
        lm_head = self.embed if config.tie_word_embeddings else weights["lm_head.weight"]
        self.lm_head = InvariantLinear([lm_head], None, tile_rows, prepack)
        attention = self._pick_attention(attention_kernel)
        self.attention_uses_tiles = attention is tiled_paged_attention
        self.layers = [DecoderLayer(config, weights, f"model.layers.{i}.", tile_rows, prepack, attention)
                       for i in range(config.num_layers)]
        self.rope = RotaryEmbedding(config).to(self.device)

    def _pick_attention(self, kind: str) -> AttentionKernel:
        """"rows": the C++ CPU kernel; "tiles": the torch kernel; "auto": rows on CPU when it builds."""
        if kind not in ("auto", "rows", "tiles"):
            raise ValueError(f"attention_kernel must be auto, rows or tiles, got {kind!r}")
        kernel = load_cpu_attention() if kind != "tiles" and self.device.type == "cpu" else None
        if kernel is None:
            if kind == "rows":
                raise RuntimeError("the rows attention kernel needs a CPU device and a C++ compiler")
            return tiled_paged_attention
        return functools.partial(row_paged_attention, kernel)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: list[KVCache],
                meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions: [T]. Writes the tokens' K/V into `caches`; returns final hidden [T, H]."""
        hidden = self.embed[input_ids]
        rope_tables = self.rope.tables(positions)
        for layer, cache in zip(self.layers, caches):
            hidden = layer.forward(hidden, rope_tables, cache, meta)
        return rms_norm(hidden, self.norm, self.config.rms_norm_eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] for the given final hidden states."""
        return self.lm_head(hidden).float()

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[KVCache]:
        cfg = self.config
        return [allocate_kv_cache(num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim, self.dtype, self.device)
                for _ in range(cfg.num_layers)]

    def kv_bytes_per_token(self) -> int:
        cfg = self.config
        return cfg.num_layers * cfg.num_kv_heads * (2 * cfg.head_dim + 1) * self.embed.element_size()
