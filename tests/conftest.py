"""Shared fixtures: a tiny random Llama checkpoint on disk (real files, real loaders) and engines on it."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

TINY_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def write_tiny_tokenizer(directory: Path) -> None:
    """A character-level BPE tokenizer with 3 special tokens; 99 ids in all."""
    from tokenizers import Tokenizer, models

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + TINY_CHARS)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": TINY_CHAT_TEMPLATE,
        "add_bos_token": False,
    }))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """Hugging Face directory of a random 2-layer Llama (vocab 128, hidden 64, GQA 4/2 heads)."""
    import transformers

    directory = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(1234)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
        tie_word_embeddings=False, rms_norm_eps=1e-5)
    model = transformers.LlamaForCausalLM(config)
    # Larger weights than the init default so that logits are spread and greedy output varies.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model.save_pretrained(directory)
    write_tiny_tokenizer(directory)
    return directory


@pytest.fixture(scope="session")
def shoal_cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shoal-cache")


@pytest.fixture
def make_tiny_engine(tiny_model_dir, shoal_cache_dir):
    """Factory: LLMEngine on the tiny model with float32 and a small KV cache unless overridden."""
    from shoal.engine.config import EngineConfig
    from shoal.engine.engine import LLMEngine

    def make(**overrides) -> LLMEngine:
        options = dict(model=str(tiny_model_dir), dtype="float32", device="cpu", kv_cache_bytes=4 << 20,
                       block_size=4, max_num_batched_tokens=64, cache_dir=str(shoal_cache_dir))
        options.update(overrides)
        return LLMEngine(EngineConfig(**options))

    return make


def run_to_completion(engine, requests: dict[str, tuple]) -> dict[str, list[int]]:
    """Adds (prompt, params) per request id, steps until done, checks invariants every step."""
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    results: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
        engine.check_integrity()
    return results


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    """URL of a real redis-server for the whole session (installed first if missing)."""
    from tests.redis_server import start_redis_server

    process, url = start_redis_server(tmp_path_factory.mktemp("redis"))
    yield url
    process.terminate()
    process.wait(timeout=30)
