"""Gemma 3 (text): Gemma 2's layer without soft caps, with per-head q/k RMSNorms, five
sliding-window layers to one global, and the local layers' own RoPE base (unscaled)."""

from __future__ import annotations

from typing import Any

from shoal.model.families import gemma2
from shoal.model.families.chat_templates import GEMMA
from shoal.model.families.family import Family
from shoal.model.families.windows import every_but_each


def hf_settings(raw: dict[str, Any]) -> dict[str, Any]:
    """Gemma 2's, with the local RoPE base: `rope_local_base_freq`, or transformers 5's
    `rope_parameters["sliding_attention"]` (which must be unscaled)."""
    local = (raw.get("rope_parameters") or {}).get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default":
        raise ValueError(f"scaled RoPE on the sliding-window layers ({local['rope_type']!r}) is not supported")
    theta = raw.get("rope_local_base_freq") or local.get("rope_theta") or 10000.0
    return dict(gemma2.hf_settings(raw), window_rope_theta=float(theta))


def gguf_settings(meta: dict[str, Any], arch: str, fields: dict[str, Any]) -> dict[str, Any]:
    """The local base is `{arch}.rope.freq_base_swa`, else llama.cpp's 10000."""
    return dict(
        gemma2.gguf_scales(fields, layers_of_27b=62),
        window_rope_theta=float(meta.get(f"{arch}.rope.freq_base_swa", 10000.0)),
    )


FAMILY = Family(
    name="gemma3",
    hf_model_types=("gemma3_text",),
    gguf_architectures=("gemma3",),
    qk_norm="head",
    norms_after=True,
    norm_offset=1.0,
    windows=every_but_each(6),
    hf_settings=hf_settings,
    gguf_settings=gguf_settings,
    chat_template=GEMMA,
    gguf_layer_names=gemma2.GEMMA_LAYER_NAMES,
)
