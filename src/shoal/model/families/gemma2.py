"""Gemma 2: RMSNorms before and after attention and the MLP, scaling by 1 + w; embeddings times
sqrt(hidden); GeGLU; scores scaled by query_pre_attn_scalar ** -0.5 and soft-capped, as are the
logits; a sliding window on every other layer, the first included."""

from __future__ import annotations

import math
from typing import Any

from shoal.model.families.chat_templates import GEMMA
from shoal.model.families.family import Family
from shoal.model.families.windows import every_but_each

# transformers' names of GELU's tanh approximation, the only activation Gemma's MLPs use.
_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh", "gelu_new")


def hf_settings(raw: dict[str, Any]) -> dict[str, Any]:
    """Gemma's scales, caps and activation from config.json."""
    activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in _GELU_TANH:
        raise ValueError(f"Gemma's MLP activation {activation!r} is not supported (only {_GELU_TANH})")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    return dict(
        mlp_activation="gelu_tanh",
        embedding_multiplier=math.sqrt(raw["hidden_size"]),
        attention_multiplier=float(raw.get("query_pre_attn_scalar") or head_dim) ** -0.5,
        attention_softcap=float(raw.get("attn_logit_softcapping") or 0.0),
        logit_softcap=float(raw.get("final_logit_softcapping") or 0.0),
    )


def gguf_scales(fields: dict[str, Any], layers_of_27b: int) -> dict[str, Any]:
    """What a Gemma GGUF file leaves to the reader, as llama.cpp takes it: the embedding scale, and
    scores scaled by head_dim ** -0.5, save in the 27B model (hidden / heads)."""
    per_head = (
        fields["hidden_size"] // fields["num_heads"] if fields["num_layers"] == layers_of_27b else fields["head_dim"]
    )
    return dict(
        mlp_activation="gelu_tanh",
        embedding_multiplier=math.sqrt(fields["hidden_size"]),
        attention_multiplier=float(per_head) ** -0.5,
    )


def gguf_settings(meta: dict[str, Any], arch: str, fields: dict[str, Any]) -> dict[str, Any]:
    return dict(
        gguf_scales(fields, layers_of_27b=46),
        attention_softcap=float(meta.get(f"{arch}.attn_logit_softcapping", 0.0)),
        logit_softcap=float(meta.get(f"{arch}.final_logit_softcapping", 0.0)),
    )


GEMMA_LAYER_NAMES = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}

FAMILY = Family(
    name="gemma2",
    hf_model_types=("gemma2",),
    gguf_architectures=("gemma2",),
    norms_after=True,
    norm_offset=1.0,
    windows=every_but_each(2),
    hf_settings=hf_settings,
    gguf_settings=gguf_settings,
    chat_template=GEMMA,
    gguf_layer_names=GEMMA_LAYER_NAMES,
)
