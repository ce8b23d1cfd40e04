"""Qwen3 (dense): per-head RMSNorm of queries and keys before RoPE, no q/k/v biases."""

from shoal.model.families.chat_templates import CHATML
from shoal.model.families.family import THINK, Family
from shoal.model.families.windows import from_max_window_layers

FAMILY = Family(
    name="qwen3",
    hf_model_types=("qwen3",),
    gguf_architectures=("qwen3",),
    qk_norm="head",
    chat_template=CHATML,
    reasoning_markers=THINK,
    windows=from_max_window_layers,
)
