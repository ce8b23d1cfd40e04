"""Qwen3 (dense): per-head RMSNorm of queries and keys before RoPE, no q/k/v biases."""

from shoal.model.families.family import Family
from shoal.model.families.windows import from_max_window_layers

FAMILY = Family(
    name="qwen3",
    hf_model_types=("qwen3",),
    gguf_architectures=("qwen3",),
    qk_norm="head",
    windows=from_max_window_layers,
)
