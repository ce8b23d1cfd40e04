"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k norms) with a mixture
of experts in its sparse layers (softmax over the experts, the best k, renormalised where
`norm_topk_prob`); `decoder_sparse_step` and `mlp_only_layers` name the layers that keep a dense MLP."""

from __future__ import annotations

from typing import Any

from shoal.model.families.chat_templates import CHATML
from shoal.model.families.family import THINK, Family
from shoal.model.families.windows import from_max_window_layers


def hf_settings(raw: dict[str, Any]) -> dict[str, Any]:
    step, dense = int(raw.get("decoder_sparse_step") or 1), set(raw.get("mlp_only_layers") or ())
    layers = range(raw["num_hidden_layers"])
    return {
        "normalize_expert_weights": bool(raw.get("norm_topk_prob", False)),
        "sparse_layers": tuple(i not in dense and (i + 1) % step == 0 for i in layers),
    }


FAMILY = Family(
    name="qwen3_moe",
    hf_model_types=("qwen3_moe",),
    gguf_architectures=("qwen3moe",),
    qk_norm="head",
    hf_settings=hf_settings,
    chat_template=CHATML,
    reasoning_markers=THINK,
    windows=from_max_window_layers,
)
