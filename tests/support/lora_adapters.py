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
