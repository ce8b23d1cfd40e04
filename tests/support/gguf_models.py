"""Tiny Llama-shaped models as GGUF files describe them: random weights in Hugging Face naming, the
llama.cpp names of each tensor, and llama.cpp's converter's rotary permutation of q/k rows."""

from __future__ import annotations

import numpy as np

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, LAYERS, VOCAB = 64, 4, 2, 16, 96, 2, 40

_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER_HF_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{_LAYER_HF_TO_GGUF[rest]}"


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_hf_weights(rng: np.random.Generator, bias: bool, tied: bool) -> dict[str, np.ndarray]:
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN), "model.norm.weight": (HIDDEN,)}
    if not tied:
        shapes["lm_head.weight"] = (VOCAB, HIDDEN)
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (HIDDEN,),
                p + "post_attention_layernorm.weight": (HIDDEN,),
                p + "self_attn.q_proj.weight": (HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.k_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.v_proj.weight": (KV_HEADS * HEAD_DIM, HIDDEN),
                p + "self_attn.o_proj.weight": (HIDDEN, HEADS * HEAD_DIM),
                p + "mlp.gate_proj.weight": (INTER, HIDDEN),
                p + "mlp.up_proj.weight": (INTER, HIDDEN),
                p + "mlp.down_proj.weight": (HIDDEN, INTER),
            }
        )
        if bias:
            shapes.update(
                {
                    p + "self_attn.q_proj.bias": (HEADS * HEAD_DIM,),
                    p + "self_attn.k_proj.bias": (KV_HEADS * HEAD_DIM,),
                    p + "self_attn.v_proj.bias": (KV_HEADS * HEAD_DIM,),
                }
            )
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}
