"""A PEFT LoRA adapter converted by llama.cpp's own convert_lora_to_gguf.py (float32) reads as the
same adapter shoal reads from the PEFT files: every pair equal, the same scaling, and an engine
serving both gives the same tokens for each."""

from __future__ import annotations

import logging

import torch

from shoal.engine.sampling_params import SamplingParams
from shoal.model.hf_loader import load_hf_config
from shoal.model.lora_adapter import load_peft_adapter
from shoal.model.lora_gguf import gguf_adapter, read_gguf_lora
from tests.support.gguf_goldens import gguf_files
from tests.support.lora_adapters import tokens_with_adapter, write_adapter
from tests.support.peer_engines import peer_python


def test_llama_cpp_s_lora_gguf_is_the_peft_adapter(tiny_model_dir, shoal_cache_dir, tmp_path):
    peer_python("gguf-convert")
    base = load_hf_config(tiny_model_dir)
    write_adapter(tiny_model_dir, tmp_path / "peft", rank=8, alpha=16)
    path = gguf_files.convert(
        tmp_path / "peft", tmp_path / "adapter.gguf", logging.getLogger(__name__).info, "f32", base=tiny_model_dir
    )
    peft = load_peft_adapter("p", tmp_path / "peft", base, max_rank=16)
    read = gguf_adapter("g", read_gguf_lora(path), base, max_rank=16)
    assert (read.rank, read.scaling, set(read.pairs)) == (peft.rank, peft.scaling, set(peft.pairs))
    for key, pair in peft.pairs.items():
        assert torch.equal(read.pairs[key].a, pair.a), key
        assert torch.equal(read.pairs[key].b, pair.b), key
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
    modules = (f"p={tmp_path / 'peft'}", f"g={path}")
    tokens = {
        name: tokens_with_adapter(tiny_model_dir, shoal_cache_dir, modules, [5, 17, 42, 8], params, name)
        for name in ("p", "g")
    }
    assert tokens["g"] == tokens["p"]
