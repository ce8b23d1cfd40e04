"""Loads a Hugging Face model directory: config.json, *.safetensors (single or sharded) and the tokenizer files.

Invariant of the produced state dict: exactly the tensors the decoder uses (see layout), in the requested
dtype; rotary `inv_freq` buffers and a tied `lm_head.weight` are dropped.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import AddedToken
from tokenizers import Tokenizer as Backend

from shoal.model.config import LlamaConfig, RopeScaling
from shoal.model.errors import ModelLoadError
from shoal.model.families import family_named, family_of_hf_model_type
from shoal.model.families.family import Family
from shoal.model.layout import check_state_dict, optional_shapes, required_shapes
from shoal.model.tokenizer import Tokenizer

_INDEX_FILE = "model.safetensors.index.json"
# Files besides the weights that change what a load produces; their identities key the weight cache.
_METADATA_FILES = (
    "config.json",
    "generation_config.json",
    _INDEX_FILE,
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


def _read_json(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot read {path}: {exc}") from exc


def _eos_list(value: Any) -> list[int]:
    return [int(v) for v in value] if isinstance(value, list) else ([int(value)] if value is not None else [])


def generation_eos_ids(model_dir: Path) -> list[int]:
    """EOS ids from generation_config.json (instruct models often list end-of-turn tokens there)."""
    path = model_dir / "generation_config.json"
    return _eos_list(_read_json(path).get("eos_token_id")) if path.is_file() else []


def config_from_hf(raw: dict[str, Any], family: Family) -> LlamaConfig:
    """The LlamaConfig of a Hugging Face config.json dict of a model of `family`."""
    heads = raw["num_attention_heads"]
    rope_parameters = raw.get("rope_parameters") or {}
    # transformers 5 gives models with two kinds of layers their RoPE per kind (Gemma 3); the
    # windowed layers' own base is the family's setting (window_rope_theta).
    rope_parameters = rope_parameters.get("full_attention", rope_parameters)
    rope = dict(raw.get("rope_scaling") or rope_parameters)
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    # Older configs state the partial rotary factor beside the rope settings, newer ones within them.
    partial = rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
    fields: dict[str, Any] = dict(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        rms_norm_eps=raw.get("rms_norm_eps", 1e-5),
        rope_theta=raw.get("rope_theta", rope_parameters.get("rope_theta", 10000.0)),
        rope_scaling=RopeScaling.from_hf(rope, raw.get("original_max_position_embeddings")),
        rotary_dim=int(head_dim * partial) if partial != 1.0 else 0,
        attention_bias=raw.get("attention_bias", family.attention_bias),
        qk_norm=family.qk_norm,
        norms_before=family.norms_before,
        norms_after=family.norms_after,
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        architecture=family.name,
        attention_windows=family.windows(raw),
        rotary_layers=family.rotary(raw),
        embedding_multiplier=raw.get("embedding_multiplier", 1.0),
        residual_multiplier=raw.get("residual_multiplier", 1.0),
        attention_multiplier=raw.get("attention_multiplier"),
        logits_scaling=raw.get("logits_scaling", 1.0),
    )
    experts = raw.get("num_local_experts") or raw.get("num_experts") or 0
    if experts:
        fields.update(
            num_experts=experts,
            experts_per_token=raw["num_experts_per_tok"],
            expert_intermediate_size=raw.get("moe_intermediate_size") or raw["intermediate_size"],
        )
    return LlamaConfig(**{**fields, **family.hf_settings(raw)})


def load_hf_config(model_dir: str | Path) -> LlamaConfig:
    """config.json as a LlamaConfig, with generation_config.json's EOS ids appended."""
    model_dir = Path(model_dir)
    raw = _read_json(model_dir / "config.json")
    family = family_of_hf_model_type(raw.get("model_type", "llama"), str(model_dir))
    if raw.get("mlp_bias"):
        raise ModelLoadError(f"{model_dir}: mlp_bias is not supported")
    try:
        config = config_from_hf(raw, family)
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{model_dir}/config.json is not a usable decoder config: {exc!r}") from exc
    eos = tuple(dict.fromkeys([*config.eos_token_ids, *generation_eos_ids(model_dir)]))
    return dataclasses.replace(config, eos_token_ids=eos)


def hf_weight_files(model_dir: str | Path) -> list[Path]:
    """The safetensors files holding the weights: those named by the shard index, else every *.safetensors."""
    model_dir = Path(model_dir)
    index = model_dir / _INDEX_FILE
    if index.is_file():
        files = [model_dir / name for name in sorted(set(_read_json(index).get("weight_map", {}).values()))]
    else:
        files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{model_dir} has no *.safetensors weights")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"{model_dir}: weight shards missing: {missing}")
    return files


def hf_source_files(model_dir: str | Path) -> list[Path]:
    """Every file whose content determines what loading `model_dir` produces."""
    model_dir = Path(model_dir)
    return [*(model_dir / n for n in _METADATA_FILES if (model_dir / n).is_file()), *hf_weight_files(model_dir)]


def load_hf_state_dict(
    model_dir: str | Path, config: LlamaConfig, dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """The decoder's tensors from all shards, cast to `dtype` and validated against `config`."""
    wanted = set(required_shapes(config)) | set(optional_shapes(config))
    family = family_named(config.architecture)
    weights: dict[str, torch.Tensor] = {}
    for path in hf_weight_files(model_dir):
        try:
            with safe_open(str(path), framework="pt") as shard:
                for name in shard.keys():
                    if name in wanted or name.endswith(family.fused_tensors):
                        for piece, tensor in family.unfuse(name, shard.get_tensor(name), config).items():
                            if family.norm_offset and piece.endswith("norm.weight"):
                                tensor = tensor.float() + family.norm_offset
                            weights[piece] = tensor.to(dtype).contiguous()
        except (OSError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot read safetensors file {path}: {exc}") from exc
    check_state_dict(config, weights, source=str(model_dir))
    return weights


def load_hf(model_dir: str | Path, dtype: torch.dtype = torch.float32) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    config = load_hf_config(model_dir)
    return config, load_hf_state_dict(model_dir, config, dtype)


def _token_content(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as strings or as serialized AddedToken dicts."""
    return value.get("content") if isinstance(value, dict) else value


def load_hf_tokenizer(model_dir: str | Path) -> Tokenizer:
    """tokenizer.json (whose post-processor alone decides BOS/EOS, as in transformers 5) plus the special
    tokens and chat template(s) of tokenizer_config.json; chat_template.jinja, when present, is the default."""
    model_dir = Path(model_dir)
    try:
        backend = Backend.from_file(str(model_dir / "tokenizer.json"))
    except Exception as exc:  # tokenizers reports missing/corrupt files as bare Exception
        raise ModelLoadError(f"cannot read {model_dir / 'tokenizer.json'}: {exc}") from exc
    config_path, map_path = model_dir / "tokenizer_config.json", model_dir / "special_tokens_map.json"
    tok_config = _read_json(config_path) if config_path.is_file() else {}
    legacy_map = _read_json(map_path) if map_path.is_file() else {}
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    special = {n: _token_content(tok_config.get(n, legacy_map.get(n))) for n in names}
    vocab = backend.get_vocab()
    backend.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t in dict.fromkeys(special.values())
            if t is not None and t in vocab
        ]
    )
    templates = tok_config.get("chat_template")
    if isinstance(templates, list):
        templates = {entry["name"]: entry["template"] for entry in templates}
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        default = jinja_file.read_text(encoding="utf-8")
        templates = {**templates, "default": default} if isinstance(templates, dict) else default
    return Tokenizer(
        backend, special_tokens=special, chat_template=templates, extra_eos_ids=generation_eos_ids(model_dir)
    )
