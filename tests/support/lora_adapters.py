"""Random LoRA adapters made with `peft`, for the tests."""

from __future__ import annotations

import peft
import torch

from shoal.model.lora_adapter import LORA_TARGETS


def write_adapter(base_dir, directory, rank=8, alpha=16, **settings):
    """A random PEFT LoRA adapter (every q/k/v/o/gate/up/down projection) for the model at base_dir;
    returns the PEFT model, for reference."""
    import transformers

    torch.manual_seed(rank + alpha)
    model = transformers.LlamaForCausalLM.from_pretrained(base_dir)
    config = peft.LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=list(LORA_TARGETS), init_lora_weights=False, **settings
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
