"""Hugging Face directories of random models of a family's real shape, for servers that take only
such a directory (`vllm serve`) and for `shoal serve` on the very same files.

A directory holds the shape's public config fields (family_shapes.SHAPES, or the Llama of that shape
with a `/llama` suffix: `qwen3-0.6b/llama`), bf16 weights drawn from N(0, 0.02) by transformers'
own model class, and SmolLM2's tokenizer with its ChatML template: so both servers tokenize the
same, and the vocabulary (and the embedding and logit matrices) is SmolLM2's 49,152 tokens rather
than the real model's. Made once under benchmarks/.peers/family-models/<name>.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from family_shapes import SHAPES, llama_of_shape
from peer_venv import PEERS_DIR

WORK = PEERS_DIR / "family-models"
VOCAB_SIZE = 49152  # SmolLM2's tokenizer
# transformers' config and model class of each model_type in SHAPES.
CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "gemma3_text": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def family_fields(name: str) -> dict:
    """The config fields of `name` (a SHAPES key, or one with `/llama` for its Llama twin)."""
    shape, _, twin = name.partition("/")
    if shape not in SHAPES or twin not in ("", "llama"):
        raise SystemExit(f"unknown served model {name!r}: one of {', '.join(SHAPES)}, each optionally with /llama")
    fields = llama_of_shape(SHAPES[shape]) if twin else dict(SHAPES[shape])
    return {**fields, "vocab_size": VOCAB_SIZE, "bos_token_id": 1, "eos_token_id": 2}


def family_directory(name: str, tokenizer_dir: Path, log: Callable[[str], None]) -> Path:
    """The directory of `name`'s random model, made if missing; the tokenizer files come from
    `tokenizer_dir` (a Hugging Face directory of SmolLM2)."""
    target = WORK / name.replace("/", "-")
    if (target / "config.json").exists():
        return target
    import shutil

    import torch
    import transformers

    fields = family_fields(name)
    model_type = fields.pop("model_type")
    config_class, model_class = CLASSES[model_type]
    log(f"  writing a random {model_type} of {name}'s shape to {target}")
    config = getattr(transformers, config_class)(**fields, torch_dtype="bfloat16")
    torch.manual_seed(0)
    with torch.device("cpu"):
        model = getattr(transformers, model_class)(config).to(torch.bfloat16).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0, 0.02)
    partial = target.with_suffix(".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    for file in tokenizer_dir.iterdir():
        if file.name.startswith(("tokenizer", "special_tokens", "vocab", "merges", "chat_template")):
            shutil.copy(file, partial / file.name)
    generation = {"bos_token_id": 1, "eos_token_id": 2}
    (partial / "generation_config.json").write_text(json.dumps(generation))
    partial.rename(target)
    return target
