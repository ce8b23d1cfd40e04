"""What a model family declares: the names its files go by and how its config and tensors differ
from the Llama layout the decoder runs. One family per module of this package; `shoal.model.families`
is the registry the loaders ask."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from shoal.model.config import LlamaConfig

# A family's per-layer sliding windows from a Hugging Face config.json (0: full attention).
WindowRule = Callable[[dict[str, Any]], tuple[int, ...]]
# Whether each layer applies RoPE, from config.json (empty: every layer does).
RotaryRule = Callable[[dict[str, Any]], tuple[bool, ...]]
# A checkpoint tensor's pieces in the decoder's names (a fused projection split in its parts).
Unfuse = Callable[[str, torch.Tensor, "LlamaConfig"], dict[str, torch.Tensor]]


# LlamaConfig fields a family reads from config.json beyond the common ones (Gemma's caps and scales).
HfSettings = Callable[[dict[str, Any]], dict[str, Any]]
# The same from a GGUF file: its metadata, its architecture (the `{arch}.` of its keys) and the
# LlamaConfig fields read so far (hidden_size, num_layers, head_dim, ...).
GgufSettings = Callable[[dict[str, Any], str, dict[str, Any]], dict[str, Any]]


# The reasoning markers of the models that write their reasoning as <think>...</think> (Qwen3, SmolLM3).
THINK = ("<think>", "</think>")


def no_settings(*source: Any) -> dict[str, Any]:
    """Nothing beyond the common fields."""
    return {}


def no_windows(raw: dict[str, Any]) -> tuple[int, ...]:
    """Full attention on every layer."""
    return ()


def rotary_everywhere(raw: dict[str, Any]) -> tuple[bool, ...]:
    """RoPE on every layer."""
    return ()


def as_named(name: str, tensor: torch.Tensor, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """The tensor as the file names it."""
    return {name: tensor}


@dataclass(frozen=True)
class Family:
    """Invariant: no two registered families share an HF model_type or a GGUF architecture.

    gguf_rows_permuted: llama.cpp's converter reorders the q and k rows of this family's files
        (LlamaModel.permute), which the GGUF loader undoes.
    attention_bias: q/k/v biases when config.json does not say (`attention_bias`).
    qk_norm, norms_before, norms_after: as LlamaConfig's.
    norm_offset: added to every RMSNorm weight of its Hugging Face files (Gemma's norms scale by
        1 + w); llama.cpp's converter has already added it in GGUF files.
    hf_settings, gguf_settings: its LlamaConfig fields beyond the common ones, from each format.
    windows: the per-layer sliding windows of its config.json.
    rotary: which layers apply RoPE, from its config.json.
    fused_tensors, unfuse: name suffixes of a checkpoint's fused tensors, and how any tensor of its
        files becomes the decoder's (Phi-3's qkv_proj and gate_up_proj split in their parts).
    chat_template: the Jinja chat template for a file that carries none (None: such a file's chats
        are refused).
    gguf_layer_names: this family's llama.cpp layer tensor names where they differ from Llama's
        (`attn_qkv.weight` -> `self_attn.qkv_proj.weight`), before `unfuse`.
    reasoning_markers: the start and end markers of the reasoning section its thinking models
        write before their answer (`<think>`, `</think>`), which the worker splits off as
        reasoning output; None for a family whose models do not think aloud.
    harmony: its models write OpenAI's harmony messages (gpt-oss: channels, recipients), which
        the worker reads into reasoning, content and tool calls.
    """

    name: str
    hf_model_types: tuple[str, ...]
    gguf_architectures: tuple[str, ...]
    gguf_rows_permuted: bool = False
    attention_bias: bool = False
    qk_norm: str = ""
    norms_before: bool = True
    norms_after: bool = False
    norm_offset: float = 0.0
    hf_settings: HfSettings = no_settings
    gguf_settings: GgufSettings = no_settings
    windows: WindowRule = no_windows
    rotary: RotaryRule = rotary_everywhere
    fused_tensors: tuple[str, ...] = ()
    unfuse: Unfuse = as_named
    chat_template: str | None = None
    gguf_layer_names: Mapping[str, str] = field(default_factory=dict)
    reasoning_markers: tuple[str, str] | None = None
    harmony: bool = False
