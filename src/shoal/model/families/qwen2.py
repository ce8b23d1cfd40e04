"""Qwen2 and Qwen2.5: q/k/v biases; a sliding window from layer max_window_layers on when enabled."""

from shoal.model.families.chat_templates import CHATML
from shoal.model.families.family import Family
from shoal.model.families.windows import from_max_window_layers

FAMILY = Family(
    name="qwen2",
    hf_model_types=("qwen2",),
    gguf_architectures=("qwen2",),
    attention_bias=True,
    chat_template=CHATML,
    windows=from_max_window_layers,
)
