"""gpt-oss: attention with a sink logit per head, q/k/v/o biases and a 128-token window on every
other layer (`layer_types`), YaRN RoPE; a mixture of experts in every layer whose router takes the
best k logits then their softmax, with biases on the router and the experts, and gpt-oss's clamped
SwiGLU. Its Hugging Face files stack the experts: `mlp.experts.gate_up_proj` [E, hidden, 2 x I]
(gate and up interleaved column by column), `down_proj` [E, I, hidden], each with a bias; split
here into one matrix a projection and expert, in the decoder's [outputs, inputs] order. llama.cpp's
`gpt-oss` files hold the experts stacked per projection as every family's, with biases beside.
Its models write harmony (analysis, commentary and final channels), which the worker reads."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from shoal.model.families.chat_templates import HARMONY
from shoal.model.families.family import Family
from shoal.model.families.windows import every_but_each

if TYPE_CHECKING:
    from shoal.model.config import LlamaConfig

_GATE_UP, _DOWN, _ROUTER = "mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.router."


def unfuse(name: str, tensor: torch.Tensor, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """The router as mlp.gate; the stacked experts as mlp.experts.{e}.gate_proj/up_proj/down_proj
    weights [outputs, inputs] and biases; others as named."""
    if _ROUTER in name:
        return {name.replace(_ROUTER, "mlp.gate."): tensor}
    if _GATE_UP not in name and _DOWN not in name:
        return {name: tensor}
    prefix = name[: name.index("mlp.experts.")]
    experts = config.num_experts
    if tensor.shape[0] != experts:
        raise ValueError(f"{name} stacks {tensor.shape[0]} experts, not {experts}")
    pieces = {}
    for e in range(experts):
        each = f"{prefix}mlp.experts.{e}."
        if name.endswith(_GATE_UP + "_bias"):
            pieces[each + "gate_proj.bias"], pieces[each + "up_proj.bias"] = tensor[e, 0::2], tensor[e, 1::2]
        elif name.endswith(_GATE_UP):
            rows = tensor[e].t()  # [2 x I, hidden], gate and up rows interleaved
            pieces[each + "gate_proj.weight"], pieces[each + "up_proj.weight"] = rows[0::2], rows[1::2]
        elif name.endswith(_DOWN + "_bias"):
            pieces[each + "down_proj.bias"] = tensor[e]
        else:
            pieces[each + "down_proj.weight"] = tensor[e].t()
    return {piece: t.contiguous() for piece, t in pieces.items()}


def hf_settings(raw: dict[str, Any]) -> dict[str, Any]:
    return {
        "attention_sinks": True,
        "mlp_activation": "swiglu_clamped",
        "swiglu_alpha": float(raw.get("swiglu_alpha", 1.702)),
        "swiglu_limit": float(raw.get("swiglu_limit", 7.0)),
        "expert_routing": "topk_softmax",
        "expert_bias": True,
    }


def gguf_settings(meta: dict[str, Any], arch: str, fields: dict[str, Any]) -> dict[str, Any]:
    """As from config.json, with llama.cpp's constants (alpha 1.702, limit 7; its files state
    neither), and the experts' weights as their softmax gives them (not renormalised)."""
    return {**hf_settings({}), "normalize_expert_weights": False}


FAMILY = Family(
    name="gpt_oss",
    hf_model_types=("gpt_oss",),
    gguf_architectures=("gpt-oss",),
    attention_bias=True,
    hf_settings=hf_settings,
    gguf_settings=gguf_settings,
    windows=every_but_each(2),  # layer_types where config.json has it: even layers windowed
    gguf_layer_names={
        "attn_sinks.weight": "self_attn.sinks",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate_inp.bias": "mlp.gate.bias",
        "ffn_gate_exps.bias": "mlp.experts.gate_proj.bias",
        "ffn_up_exps.bias": "mlp.experts.up_proj.bias",
        "ffn_down_exps.bias": "mlp.experts.down_proj.bias",
    },
    fused_tensors=(_GATE_UP, _GATE_UP + "_bias", _DOWN, _DOWN + "_bias", "mlp.router.weight", "mlp.router.bias"),
    unfuse=unfuse,
    chat_template=HARMONY,
    harmony=True,
)
