"""The model families shoal runs, one module each; the loaders find a file's family here.

Adding a family is a module declaring its `FAMILY` (see family.Family) and a line below."""

from __future__ import annotations

from shoal.model.errors import ModelLoadError
from shoal.model.families import (
    gemma2,
    gemma3,
    gpt_oss,
    granite,
    llama,
    mistral,
    mixtral,
    olmo2,
    phi3,
    qwen2,
    qwen3,
    qwen3_moe,
    smollm3,
)
from shoal.model.families.family import Family

FAMILIES: tuple[Family, ...] = (
    llama.FAMILY,
    mistral.FAMILY,
    qwen2.FAMILY,
    qwen3.FAMILY,
    smollm3.FAMILY,
    granite.FAMILY,
    olmo2.FAMILY,
    phi3.FAMILY,
    gemma2.FAMILY,
    gemma3.FAMILY,
    mixtral.FAMILY,
    qwen3_moe.FAMILY,
    gpt_oss.FAMILY,
)

_BY_NAME = {family.name: family for family in FAMILIES}
_BY_HF_TYPE = {model_type: family for family in FAMILIES for model_type in family.hf_model_types}
_BY_GGUF_ARCHITECTURE = {arch: family for family in FAMILIES for arch in family.gguf_architectures}
if len(_BY_HF_TYPE) != sum(len(f.hf_model_types) for f in FAMILIES) or len(_BY_GGUF_ARCHITECTURE) != sum(
    len(f.gguf_architectures) for f in FAMILIES
):
    raise ImportError("two model families claim the same model_type or GGUF architecture")


def family_named(name: str) -> Family:
    """A registered family by its name (LlamaConfig.architecture)."""
    if name not in _BY_NAME:
        raise ModelLoadError(f"no model family {name!r} ({sorted(_BY_NAME)})")
    return _BY_NAME[name]


def family_of_hf_model_type(model_type: str, source: str) -> Family:
    """The family of a config.json's model_type; ModelLoadError naming `source` if none runs it."""
    if model_type not in _BY_HF_TYPE:
        raise ModelLoadError(f"{source}: model_type {model_type!r} is not supported ({sorted(_BY_HF_TYPE)})")
    return _BY_HF_TYPE[model_type]


def family_of_gguf_architecture(architecture: str | None, source: str) -> Family:
    """The family of a GGUF file's general.architecture; ModelLoadError naming `source` if none runs it."""
    if architecture not in _BY_GGUF_ARCHITECTURE:
        raise ModelLoadError(
            f"{source}: GGUF architecture {architecture!r} is not supported ({sorted(_BY_GGUF_ARCHITECTURE)})"
        )
    return _BY_GGUF_ARCHITECTURE[architecture]
