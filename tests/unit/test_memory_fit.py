"""A model that cannot fit is refused before any weight is loaded, with the figures."""

from __future__ import annotations

import pytest
import torch

from shoal import LLM
from shoal.engine import engine as engine_module
from shoal.engine import memory_fit
from shoal.model.inspection import inspect_model

MODEL = "smollm2-135m-instruct"


def test_the_least_weight_memory_counts_kept_blocks_as_they_are_and_the_rest_at_the_dtype():
    report = inspect_model(MODEL)
    kept = report.weight_bytes_in_memory(2, keep_quantized=True)
    dense = report.weight_bytes_in_memory(2, keep_quantized=False)
    assert dense == report.parameters * 2 and 0.99 * report.weight_bytes < kept < dense  # its F32 norms in bf16


def test_a_model_larger_than_the_free_memory_is_refused_with_its_figures(monkeypatch):
    monkeypatch.setattr(memory_fit, "free_memory_bytes", lambda device: 50 * 2**20)
    with pytest.raises(MemoryError, match=r"does not fit: its weights take at least 0\.\d\d GiB in torch\.bfloat16"):
        memory_fit.check_fits(MODEL, torch.bfloat16, True, 0, torch.device("cpu"))
    monkeypatch.setattr(memory_fit, "free_memory_bytes", lambda device: 2**30)
    memory_fit.check_fits(MODEL, torch.bfloat16, True, 0, torch.device("cpu"))
    with pytest.raises(MemoryError, match=r"and 2\.00 GiB of KV cache"):
        memory_fit.check_fits(MODEL, torch.bfloat16, True, 2 * 2**30, torch.device("cpu"))


def test_the_engine_refuses_before_loading_a_weight(monkeypatch, shoal_cache_dir):
    monkeypatch.setattr(memory_fit, "free_memory_bytes", lambda device: 2**20)

    def never(*args, **kwargs):
        raise AssertionError("the checkpoint was loaded")

    monkeypatch.setattr(engine_module, "load_checkpoint", never)
    with pytest.raises(MemoryError, match="does not fit"):
        LLM(MODEL, cache_dir=str(shoal_cache_dir))
