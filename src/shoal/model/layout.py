"""The decoder's tensors in Hugging Face naming and torch shape order, derived from a `LlamaConfig`."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from shoal.model.config import LlamaConfig
from shoal.model.errors import ModelLoadError


@dataclass(frozen=True)
class LayerNorms:
    """The names of a layer's RMSNorm weights by place (None where the model has none): before and
    after attention, before and after the MLP."""

    before_attention: str | None
    after_attention: str | None
    before_mlp: str | None
    after_mlp: str | None

    def names(self) -> list[str]:
        return [n for n in (self.before_attention, self.after_attention, self.before_mlp, self.after_mlp) if n]


def layer_norms(config: LlamaConfig) -> LayerNorms:
    """Llama: input_layernorm, post_attention_layernorm (before the MLP). OLMo 2:
    post_attention_layernorm and post_feedforward_layernorm (after each). Gemma, both: the MLP's
    input norm is then pre_feedforward_layernorm."""
    if not config.norms_after:
        return LayerNorms("input_layernorm", None, "post_attention_layernorm", None)
    before_mlp = "pre_feedforward_layernorm" if config.norms_before else None
    before_attention = "input_layernorm" if config.norms_before else None
    return LayerNorms(before_attention, "post_attention_layernorm", before_mlp, "post_feedforward_layernorm")


def required_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the decoder must have. Invariant: lm_head.weight is listed iff embeddings are untied."""
    hidden = config.hidden_size
    q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q_rows, hidden),
                p + "self_attn.k_proj.weight": (kv_rows, hidden),
                p + "self_attn.v_proj.weight": (kv_rows, hidden),
                p + "self_attn.o_proj.weight": (hidden, q_rows),
            }
        )
        shapes.update(mlp_shapes(config, i))
        shapes.update({f"{p}{norm}.weight": (hidden,) for norm in layer_norms(config).names()})
        if config.qk_norm:
            per_head = config.qk_norm == "head"
            shapes[p + "self_attn.q_norm.weight"] = (config.head_dim if per_head else q_rows,)
            shapes[p + "self_attn.k_norm.weight"] = (config.head_dim if per_head else kv_rows,)
        if config.attention_sinks:
            shapes[p + "self_attn.sinks"] = (config.num_heads,)
        if config.attention_bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (q_rows,),
                    p + "self_attn.k_proj.bias": (kv_rows,),
                    p + "self_attn.v_proj.bias": (kv_rows,),
                }
            )
    return shapes


def mlp_shapes(config: LlamaConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Layer `layer`'s MLP: gate, up and down projections; in a sparse layer, its router
    (mlp.gate) and those of each expert (mlp.experts.{e}.)."""
    p, hidden = f"model.layers.{layer}.mlp.", config.hidden_size

    def swiglu(prefix: str, inter: int) -> dict[str, tuple[int, ...]]:
        return {
            prefix + "gate_proj.weight": (inter, hidden),
            prefix + "up_proj.weight": (inter, hidden),
            prefix + "down_proj.weight": (hidden, inter),
        }

    if not config.sparse(layer):
        return swiglu(p, config.intermediate_size)
    shapes = {p + "gate.weight": (config.num_experts, hidden)}
    if config.expert_bias:
        shapes[p + "gate.bias"] = (config.num_experts,)
    inter = config.expert_intermediate_size
    for expert in range(config.num_experts):
        e = f"{p}experts.{expert}."
        shapes.update(swiglu(e, inter))
        if config.expert_bias:
            shapes.update(
                {e + "gate_proj.bias": (inter,), e + "up_proj.bias": (inter,), e + "down_proj.bias": (hidden,)}
            )
    return shapes


def optional_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Tensors the decoder uses when a checkpoint has them (Llama's attention_bias also biases o_proj)."""
    return {f"model.layers.{i}.self_attn.o_proj.bias": (config.hidden_size,) for i in range(config.num_layers)}


def check_state_dict(config: LlamaConfig, weights: Mapping[str, torch.Tensor], source: str) -> None:
    """Raises ModelLoadError unless `weights` has exactly the required tensors (plus optional ones) in shape."""
    required, optional = required_shapes(config), optional_shapes(config)
    missing = sorted(set(required) - set(weights))
    unexpected = sorted(set(weights) - set(required) - set(optional))
    if missing or unexpected:
        raise ModelLoadError(f"{source}: missing tensors {missing[:8]}, unexpected tensors {unexpected[:8]}")
    for name, tensor in weights.items():
        want = required.get(name) or optional[name]
        if tuple(tensor.shape) != want:
            raise ModelLoadError(f"{source}: tensor {name} has shape {tuple(tensor.shape)}, expected {want}")
