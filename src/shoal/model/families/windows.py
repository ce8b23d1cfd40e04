"""Per-layer sliding windows as transformers reads them from config.json (0: full attention)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _layer_types(raw: dict[str, Any], window: int) -> tuple[int, ...] | None:
    """`layer_types` where config.json has it: "sliding_attention" layers get `window`."""
    types = raw.get("layer_types")
    if types is None:
        return None
    layers = raw["num_hidden_layers"]
    if len(types) != layers:
        raise ValueError(f"layer_types names {len(types)} layers, num_hidden_layers is {layers}")
    return tuple(window if kind == "sliding_attention" else 0 for kind in types)


def from_layer_types(raw: dict[str, Any]) -> tuple[int, ...]:
    """`sliding_window` on the layers `layer_types` names "sliding_attention" (SmolLM3)."""
    window = raw.get("sliding_window")
    return (_layer_types(raw, int(window)) or ()) if window else ()


def every_layer(raw: dict[str, Any]) -> tuple[int, ...]:
    """`sliding_window` on every layer when set (Mistral)."""
    window = raw.get("sliding_window")
    if not window:
        return ()
    return _layer_types(raw, int(window)) or (int(window),) * raw["num_hidden_layers"]


def from_max_window_layers(raw: dict[str, Any]) -> tuple[int, ...]:
    """With `use_sliding_window`, `sliding_window` from layer `max_window_layers` on (Qwen2, Qwen3)."""
    window = raw.get("sliding_window")
    if not raw.get("use_sliding_window") or not window:
        return ()
    layers = raw["num_hidden_layers"]
    first = raw.get("max_window_layers", layers)
    return _layer_types(raw, int(window)) or tuple(int(window) if i >= first else 0 for i in range(layers))


def every_but_each(pattern: int) -> Callable[[dict[str, Any]], tuple[int, ...]]:
    """A rule: `sliding_window` on every layer but each `pattern`-th (counting from 1; config.json's
    `sliding_window_pattern` where it states one), as transformers' `layer_types` default and
    llama.cpp's swa pattern put it (Gemma 2: 2, Gemma 3: 6); `layer_types`, where present, decides."""

    def windows(raw: dict[str, Any]) -> tuple[int, ...]:
        window = raw.get("sliding_window")
        if not window:
            return ()
        every = int(raw.get("sliding_window_pattern") or pattern)
        layers = range(raw["num_hidden_layers"])
        return _layer_types(raw, int(window)) or tuple(int(window) if (i + 1) % every else 0 for i in layers)

    return windows
