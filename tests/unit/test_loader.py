"""load_checkpoint: name/path -> frozen Checkpoint with HF-named weights in the requested dtype, via the cache."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer as Backend
from tokenizers import models, pre_tokenizers

from shoal.model.errors import ModelLoadError
from shoal.model.loader import Checkpoint, load_checkpoint


@pytest.fixture
def hf_dir(tmp_path: Path) -> Path:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    path = tmp_path / "model"
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    backend = Backend(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(path / "tokenizer.json"))
    return path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_directory_checkpoint(hf_dir: Path, tmp_path: Path, dtype: torch.dtype) -> None:
    checkpoint = load_checkpoint(str(hf_dir), dtype=dtype, cache_dir=tmp_path / "cache")
    assert isinstance(checkpoint, Checkpoint) and checkpoint.source == str(hf_dir)
    assert checkpoint.config.num_layers == 1 and checkpoint.config.tie_word_embeddings
    assert {t.dtype for t in checkpoint.weights.values()} == {dtype} and "lm_head.weight" not in checkpoint.weights
    assert checkpoint.tokenizer.encode("hello world") == [1, 2]
    with pytest.raises(dataclasses.FrozenInstanceError):
        checkpoint.source = "elsewhere"  # type: ignore[misc]
    assert len(list((tmp_path / "cache").glob("*.safetensors"))) == 1


def test_unwritable_cache_falls_back_to_memory(hf_dir: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("")
    checkpoint = load_checkpoint(str(hf_dir), cache_dir=blocker / "cache")
    assert checkpoint.weights["model.norm.weight"].shape == (16,)


def test_bad_requests_raise_model_load_error(hf_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="dtype"):
        load_checkpoint(str(hf_dir), dtype=torch.int8)
    with pytest.raises(ModelLoadError, match="known names"):
        load_checkpoint("no-such-model")
    assert issubclass(ModelLoadError, ValueError)
