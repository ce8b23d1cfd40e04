"""Random LoRA adapters made with `peft`, for the tests."""

from __future__ import annotations

import peft
import torch

from shoal.model.lora_adapter import LORA_TARGETS

FUSED_TARGETS = ("qkv_proj", "gate_up_proj")  # Phi-3's fused projections (no other family has them)


def write_adapter(base_dir, directory, rank=8, alpha=16, **settings):
    """A random PEFT LoRA adapter (every q/k/v/o/gate/up/down projection) for the model at base_dir
    (any family transformers knows); returns the PEFT model, for reference."""
    import transformers

    torch.manual_seed(rank + alpha)
    model = transformers.AutoModelForCausalLM.from_pretrained(base_dir)
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=alpha,
        target_modules=[*LORA_TARGETS, *FUSED_TARGETS],
        init_lora_weights=False,
        **settings,
    )
    adapted = peft.get_peft_model(model, config)
    adapted.save_pretrained(directory)
    return adapted


def tokens_with_adapter(
    model_dir, cache_dir, modules: tuple[str, ...], prompt, params, adapter: str | None
) -> list[int]:
    """A request's output tokens from an engine of the tiny model in float32 serving `modules`
    (name=path), run with `adapter` (None: the base model): what a worker serving them should give."""
    from shoal.config.engine import EngineConfig
    from shoal.engine.engine import LLMEngine
    from tests.support.engine_runs import run_to_completion

    config = EngineConfig(
        model=str(model_dir),
        dtype="float32",
        device="cpu",
        kv_cache_bytes=8 << 20,
        cache_dir=str(cache_dir),
        enable_lora=True,
        lora_modules=modules,
    )
    return run_to_completion(LLMEngine(config), {"r": (prompt, params, adapter)})["r"]


def write_gguf_lora(peft_dir, out, num_heads: int, num_kv_heads: int, half: bool = False):
    """The PEFT adapter in `peft_dir` as llama.cpp's convert_lora_to_gguf.py writes a Llama one: its
    alpha, each pair as `blk.N.<tensor>.weight.lora_a`/`.lora_b`, the B rows of q and k in the
    converter's rotary order, float16 where `half`. Returns `out`."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from tests.support.gguf_models import gguf_name, llama_cpp_permute

    settings = json.loads((peft_dir / "adapter_config.json").read_text())
    writer = gguf.GGUFWriter(str(out), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, float(settings["lora_alpha"]))
    for key, array in sorted(load_file(str(peft_dir / "adapter_model.safetensors")).items()):
        module, half_name = key.removeprefix("base_model.model.").rsplit(".lora_", 1)
        tensor = gguf_name(module + ".weight") + (".lora_a" if half_name.startswith("A") else ".lora_b")
        if half_name.startswith("B") and module.endswith(("q_proj", "k_proj")):
            array = llama_cpp_permute(array, num_heads if module.endswith("q_proj") else num_kv_heads)
        writer.add_tensor(tensor, np.ascontiguousarray(array, dtype=np.float16 if half else np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out
