"""`load_checkpoint`: a model name or path -> config, HF-named weights and tokenizer, through the weight cache."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from shoal.model.config import LlamaConfig
from shoal.model.errors import ModelLoadError
from shoal.model.families import family_named
from shoal.model.gguf_loader import gguf_config, gguf_metadata, gguf_state_dict, open_gguf
from shoal.model.hf_loader import hf_source_files, load_hf, load_hf_tokenizer
from shoal.model.partial_rotary import gather_rotary_dims
from shoal.model.quantized_weight import QuantizedWeight
from shoal.model.registry import ModelSource, resolve_model
from shoal.model.tokenizer import Tokenizer
from shoal.model.weight_cache import CACHE_DTYPES, WeightCache, Weights

__all__ = ["Checkpoint", "ModelLoadError", "load_checkpoint"]

_TOKENIZER_KEY = "tokenizer"
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Checkpoint:
    """A loaded model. Invariant: `weights` has exactly the decoder's tensors (HF names), each in one
    dtype or a QuantizedWeight; when the cache is writable they are memory-mapped from it and shared
    between processes."""

    config: LlamaConfig
    weights: dict[str, torch.Tensor | QuantizedWeight]
    tokenizer: Tokenizer
    source: str


def _convert(source: ModelSource, dtype: torch.dtype, keep_quantized: bool) -> tuple[LlamaConfig, Weights, Tokenizer]:
    if source.kind == "gguf":
        reader = open_gguf(source.path)
        metadata = gguf_metadata(reader)
        config = gguf_config(reader, metadata)
        weights = gguf_state_dict(reader, config, dtype, keep_quantized)
        tokenizer = Tokenizer.from_gguf_metadata(metadata, source.path)
    else:
        config, weights = load_hf(source.path, dtype)
        tokenizer = load_hf_tokenizer(source.path)
    try:
        weights = gather_rotary_dims(weights, config)
    except ValueError as exc:
        raise ModelLoadError(f"{source.path}: {exc}") from exc
    return config, weights, _with_family_template(tokenizer, config, source)


def _with_family_template(tokenizer: Tokenizer, config: LlamaConfig, source: ModelSource) -> Tokenizer:
    """A file without a chat template gets its family's, logged; one with a template keeps it."""
    family = family_named(config.architecture)
    if tokenizer.has_chat_template or family.chat_template is None:
        return tokenizer
    logger.info("%s has no chat template: using the %s family's default", source.path, family.name)
    return tokenizer.with_default_chat_template(family.chat_template)


def load_checkpoint(
    name_or_path: str,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | Path | None = None,
    keep_quantized: bool = False,
) -> Checkpoint:
    """Resolves `name_or_path` (see registry), converts it on a cache miss, and returns it memory-mapped.
    With keep_quantized, a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K matrices stay QuantizedWeight blocks.

    cache_dir defaults to `$SHOAL_CACHE_DIR` or `~/.cache/shoal`. If the cache cannot be written, the
    converted weights are returned from memory (logged as a warning).
    """
    if dtype not in CACHE_DTYPES:
        raise ModelLoadError(f"dtype {dtype} is not supported; use one of {CACHE_DTYPES}")
    source = resolve_model(name_or_path)
    files = [source.path] if source.kind == "gguf" else hf_source_files(source.path)
    cache = WeightCache(cache_dir)
    quantized = keep_quantized and source.kind == "gguf"
    entry = cache.load(files, dtype, quantized)
    if entry is None:
        config, weights, tokenizer = _convert(source, dtype, quantized)
        try:
            cache.store(files, dtype, config, weights, {_TOKENIZER_KEY: tokenizer.to_json()}, quantized)
        except OSError as exc:
            logger.warning("weight cache %s is not writable (%s); using unshared in-memory weights", cache.root, exc)
            return Checkpoint(config=config, weights=weights, tokenizer=tokenizer, source=str(source.path))
        del weights
        entry = cache.load(files, dtype, quantized)
        if entry is None:
            raise ModelLoadError(f"weight cache entry for {source.path} was written but cannot be read back")
    if _TOKENIZER_KEY not in entry.extra:
        raise ModelLoadError(f"weight cache entry {entry.path} has no tokenizer")
    return Checkpoint(
        config=entry.config,
        weights=entry.weights,
        tokenizer=Tokenizer.from_json(entry.extra[_TOKENIZER_KEY]),
        source=str(source.path),
    )
