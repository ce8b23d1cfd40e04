"""Hugging Face model directories -> LlamaConfig, decoder state dict and tokenizer, compared with transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from shoal.model.errors import ModelLoadError
from shoal.model.hf_loader import hf_source_files, load_hf, load_hf_tokenizer

_SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    bos_token_id=1,
    eos_token_id=2,
)


def _save(model: transformers.PreTrainedModel, path: Path, **kwargs) -> dict[str, torch.Tensor]:
    model.save_pretrained(path, **kwargs)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def test_llama_untied_with_llama3_rope(tmp_path: Path) -> None:
    torch.manual_seed(0)
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
        "rope_theta": 50000.0,
    }
    cfg = transformers.LlamaConfig(**_SMALL, rope_scaling=rope, tie_word_embeddings=False, rms_norm_eps=1e-6)
    reference = _save(transformers.LlamaForCausalLM(cfg), tmp_path)
    config, weights = load_hf(tmp_path)
    assert (config.num_layers, config.hidden_size, config.head_dim) == (2, 32, 8)
    assert (config.num_heads, config.num_kv_heads) == (4, 2)
    assert (config.vocab_size, config.intermediate_size, config.rms_norm_eps) == (64, 48, 1e-6)
    assert config.rope_theta == 50000.0 and not config.tie_word_embeddings and not config.attention_bias
    assert (config.rope_scaling.rope_type, config.rope_scaling.factor) == ("llama3", 8.0)
    assert config.rope_scaling.original_max_position_embeddings == 64
    assert set(weights) == {k for k in reference if "rotary" not in k}
    for name, tensor in weights.items():
        assert tensor.dtype == torch.float32 and torch.equal(tensor, reference[name]), name


def test_qwen2_tied_with_bias_sharded_in_bfloat16(tmp_path: Path) -> None:
    torch.manual_seed(1)
    cfg = transformers.Qwen2Config(**_SMALL, tie_word_embeddings=True)
    reference = _save(transformers.Qwen2ForCausalLM(cfg), tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    config, weights = load_hf(tmp_path, dtype=torch.bfloat16)
    assert config.architecture == "qwen2" and config.attention_bias and config.tie_word_embeddings
    assert "lm_head.weight" not in weights and "model.layers.1.self_attn.q_proj.bias" in weights
    assert set(weights) == {k for k in reference if "rotary" not in k and k != "lm_head.weight"}
    for name, tensor in weights.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, reference[name].to(torch.bfloat16)), name
    shards = [p for p in hf_source_files(tmp_path) if p.suffix == ".safetensors"]
    assert len(shards) > 1 and (tmp_path / "config.json") in hf_source_files(tmp_path)


def test_unsupported_or_broken_directories(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma", **_SMALL}))
    with pytest.raises(ModelLoadError, match="gemma"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **_SMALL, "num_attention_heads": 4}))
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_hf(tmp_path)


_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_TEXTS = [
    "Hello world",
    "  leading spaces and\ttabs\n\nnewlines",
    "numbers 1234567 3.14",
    "<|im_start|>user\nhi<|im_end|>",
    "unicode: héllo wörld ñ 日本語 😀🚀",
    "",
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE trained on a few lines, saved the way hub repositories ship tokenizers."""
    path = tmp_path_factory.mktemp("tok")
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    backend.train_from_iterator(_TEXTS * 3 + ["the quick brown fox jumps over the lazy dog"] * 5, trainer)
    backend.post_processor = processors.TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", 1)]
    )
    backend.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "add_bos_token": False,  # ignored: tokenizer.json rules
                "bos_token": {"__type": "AddedToken", "content": "<|im_start|>", "special": True},
                "eos_token": "<|endoftext|>",
                "chat_template": "unused, chat_template.jinja wins",
            }
        )
    )
    (path / "chat_template.jinja").write_text(_CHAT_TEMPLATE)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 3]}))
    return path


def test_tokenizer_matches_transformers(tokenizer_dir: Path) -> None:
    ours = load_hf_tokenizer(tokenizer_dir)
    reference = transformers.AutoTokenizer.from_pretrained(str(tokenizer_dir))
    for text in _TEXTS:
        for special in (True, False):
            ids = ours.encode(text, add_special_tokens=special)
            assert ids == reference.encode(text, add_special_tokens=special), (text, special)
            assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert ours.bos_token_id == 1 and ours.encode("hi") == [1, *ours.encode("hi", add_special_tokens=False)]
    # eos_token, then generation_config's extra ids (deduplicated), then the template's end-of-turn token
    assert ours.eos_token_ids == (0, 3, 2)
    messages = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello"}]
    assert ours.apply_chat_template(messages) == reference.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
