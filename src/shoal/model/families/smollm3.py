"""SmolLM3: Llama's layout with no RoPE on some layers (`no_rope_layers`, by default every fourth: a
GGUF file has no key for them, llama.cpp too takes every fourth)."""

from __future__ import annotations

from typing import Any

from shoal.model.families.chat_templates import CHATML
from shoal.model.families.family import THINK, Family
from shoal.model.families.windows import from_layer_types


def rotary_layers(raw: dict[str, Any]) -> tuple[bool, ...]:
    """`no_rope_layers` (1: the layer applies RoPE), else a layer without it every
    `no_rope_layer_interval` layers, as transformers' SmolLM3Config builds it."""
    layers = raw["num_hidden_layers"]
    flags = raw.get("no_rope_layers")
    if flags is None:
        interval = raw.get("no_rope_layer_interval", 4)
        flags = [(i + 1) % interval != 0 for i in range(layers)]
    if len(flags) != layers:
        raise ValueError(f"no_rope_layers names {len(flags)} layers, num_hidden_layers is {layers}")
    return tuple(bool(flag) for flag in flags)


FAMILY = Family(
    name="smollm3",
    hf_model_types=("smollm3",),
    gguf_architectures=("smollm3",),
    gguf_rows_permuted=True,
    chat_template=CHATML,
    reasoning_markers=THINK,
    windows=from_layer_types,
    rotary=rotary_layers,
)
