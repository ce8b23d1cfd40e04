"""Tiny random models of every family transformers can build: the config fields they share, and
per variant (config class, model class, config fields), those of the whole model (VARIANTS) and
those that change the layer (LAYER_VARIANTS, run on both the fused and the torch layer)."""

from __future__ import annotations

COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=1,
    eos_token_id=2,
)


def longrope(pairs: int) -> dict:
    """Distinct short and long factors for `pairs` rotated pairs."""
    return {
        "rope_type": "longrope",
        "short_factor": [1.0 + 0.25 * i for i in range(pairs)],
        "long_factor": [2.0 + 0.5 * i for i in range(pairs)],
    }


VARIANTS = {
    "llama-tied": ("LlamaConfig", "LlamaForCausalLM", dict(tie_word_embeddings=True)),
    "llama3-rope": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
            rope_theta=500000.0,
        ),
    ),
    "linear-rope": ("LlamaConfig", "LlamaForCausalLM", dict(rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "qwen2-bias": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None)),
    # YaRN past an original context of 32 positions (the prompt is 120).
    "qwen3-yarn": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(
            head_dim=16,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "rope_theta": 10000.0,
            },
        ),
    ),
}
# Variants of the layer itself, on both paths: the fused native layer (rows) and the torch layer
# (tiles). Windows are shorter than the 120-token prompt, and not a multiple of the 16-key tiles.
LAYER_VARIANTS = {
    "qwen3-qk-norm": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=16, tie_word_embeddings=True)),
    "granite-multipliers": (
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(embedding_multiplier=3.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0),
    ),
    "olmo2-norms-after": ("Olmo2Config", "Olmo2ForCausalLM", dict(pad_token_id=0)),
    "phi3-fused-projections": ("Phi3Config", "Phi3ForCausalLM", dict(pad_token_id=0)),
    # longrope's short factors: the engine serves 128 positions, the original context (ENGINE_OPTIONS).
    "phi3-longrope-short": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(pad_token_id=0, original_max_position_embeddings=128, rope_scaling=longrope(8)),
    ),
    # Phi-4-mini's shape: RoPE on 12 of 16 dimensions, and longrope's long factors (the prompt and
    # the served context both pass the original 64 positions).
    "phi4-mini-partial-longrope": (
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(pad_token_id=0, partial_rotary_factor=0.75, original_max_position_embeddings=64, rope_scaling=longrope(6)),
    ),
    "smollm3-no-rope-layer-1": ("SmolLM3Config", "SmolLM3ForCausalLM", dict(no_rope_layer_interval=2, pad_token_id=0)),
    "mistral-window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=21)),
    # Every other layer windowed, soft caps on scores and logits, norms before and after, GeGLU.
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            head_dim=16,
            sliding_window=21,
            num_hidden_layers=3,
            attn_logit_softcapping=2.0,
            final_logit_softcapping=1.5,
        ),
    ),
    # Layers 0-1 local (their own RoPE base), layer 2 global with linear RoPE scaling; q/k norms.
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            sliding_window=21,
            num_hidden_layers=3,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
            },
        ),
    ),
    "qwen2-window-from-layer-1": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        dict(use_sliding_window=True, sliding_window=21, max_window_layers=1),
    ),
}
# One layer variant of each family beyond Llama's, on which every serving feature is checked per
# family: Gemma 2 and 3 (windows shorter than the prompts), Granite, OLMo 2, Phi-4-mini's shape, Qwen3.
FAMILIES = [
    "gemma2",
    "gemma3",
    "granite-multipliers",
    "olmo2-norms-after",
    "phi4-mini-partial-longrope",
    "qwen3-qk-norm",
]
