"""Phi-3 and Phi-3.5 (mini, medium): Llama's layer with q/k/v in one projection (qkv_proj) and gate/up
in another (gate_up_proj, gate first), split when loaded, from Hugging Face files or GGUF (llama.cpp's
attn_qkv and fused ffn_up). Phi-3.5 and Phi-4-mini rotate by longrope (RopeScaling: short or long
factors by the context served) and Phi-4-mini only part of each head (partial_rotary)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from shoal.model.families.chat_templates import PHI3
from shoal.model.families.family import Family

if TYPE_CHECKING:
    from shoal.model.config import LlamaConfig

QKV, GATE_UP = "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"


def unfuse(name: str, tensor: torch.Tensor, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """qkv_proj as q_proj, k_proj and v_proj; gate_up_proj as gate_proj and up_proj; others as named."""
    if name.endswith(QKV):
        prefix = name[: -len(QKV)]
        q_rows, kv_rows = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        if tensor.shape[0] != q_rows + 2 * kv_rows:
            raise ValueError(f"{name} has {tensor.shape[0]} rows, not {q_rows} + 2 x {kv_rows}")
        q, k, v = tensor.split([q_rows, kv_rows, kv_rows])
        return {f"{prefix}self_attn.{part}_proj.weight": t for part, t in zip("qkv", (q, k, v))}
    if name.endswith(GATE_UP):
        prefix = name[: -len(GATE_UP)]
        if tensor.shape[0] != 2 * config.intermediate_size:
            raise ValueError(f"{name} has {tensor.shape[0]} rows, not 2 x {config.intermediate_size}")
        gate, up = tensor.chunk(2)
        return {f"{prefix}mlp.gate_proj.weight": gate, f"{prefix}mlp.up_proj.weight": up}
    return {name: tensor}


FAMILY = Family(
    name="phi3",
    hf_model_types=("phi3",),
    gguf_architectures=("phi3",),
    fused_tensors=(QKV, GATE_UP),
    unfuse=unfuse,
    gguf_layer_names={"attn_qkv.weight": QKV, "ffn_up.weight": GATE_UP},
    chat_template=PHI3,
)
