"""shoal's model against transformers' implementation on the same weights, in float32: shoal on the
GGUF's Q4_1/Q8_0 blocks as they are (the default), transformers on them dequantized (the float32
kernels are checked against float64 in tests/unit/test_invariant_linear.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shoal import LLM, SamplingParams
from shoal.model.registry import resolve_model
from tests.support.logits import forward_logits, max_logit_difference

PROMPTS = [
    "What is the capital of France? Answer in one paragraph.",
    "Write a short poem about the sea.",
    "Explain how a hash table works.",
    "List five fruits and describe each one.",
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def smollm2_source() -> Path:
    return resolve_model("smollm2-135m-instruct").path


@pytest.fixture(scope="module")
def smollm2_transformers(smollm2_source):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_source.parent), gguf_file=smollm2_source.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def smollm2_shoal(shoal_cache_dir):
    return LLM(
        "smollm2-135m-instruct", dtype="float32", device="cpu", kv_cache_bytes=64 << 20, cache_dir=str(shoal_cache_dir)
    )


def test_tiny_model_logits_match(tiny_model_dir, shoal_cache_dir):
    import transformers

    reference = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    assert max_logit_difference(reference, tiny_model_dir, shoal_cache_dir, list(range(3, 60))) <= 1e-3


def test_smollm2_logits_match(smollm2_transformers, shoal_cache_dir):
    llm = LLM(
        "smollm2-135m-instruct", dtype="float32", device="cpu", kv_cache_bytes=16 << 20, cache_dir=str(shoal_cache_dir)
    )
    assert llm.engine.model.layers[0].gate_up.description == "native q4_1"  # the blocks as they are
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(
        tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}]), add_special_tokens=False
    )
    with torch.no_grad():
        expected = smollm2_transformers(torch.tensor([ids])).logits[0]
    assert (forward_logits(llm, ids) - expected).abs().max().item() <= 1e-3


def test_smollm2_greedy_continuations_are_transformers_argmax_at_every_step(smollm2_shoal, smollm2_transformers):
    """Every token shoal picks greedily is transformers' argmax after the same prefix (one
    teacher-forced forward of prompt and continuation), so transformers' greedy decoding gives the
    same continuation; it ends at an end-of-sequence token or at max_tokens."""
    tokenizer = smollm2_shoal.get_tokenizer()
    eos = set(smollm2_shoal.engine.eos_token_ids)
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
        for p in PROMPTS
    ]
    ours = smollm2_shoal.generate(prompts, SamplingParams(temperature=0, max_tokens=64))
    for prompt, output in zip(prompts, ours):
        tokens = output.outputs[0].token_ids
        assert len(tokens) == 64 or (tokens[-1] in eos and not eos & set(tokens[:-1])), tokens
        with torch.no_grad():
            logits = smollm2_transformers(torch.tensor([prompt + tokens])).logits[0]
        assert logits[len(prompt) - 1 : -1].argmax(-1).tolist() == tokens
