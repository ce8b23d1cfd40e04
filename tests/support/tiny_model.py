"""The tiny random Llama the tests (and the quick benchmark modes) run on: real files, real loaders."""

from __future__ import annotations

import json
from pathlib import Path

import torch

TINY_CHARS = [chr(c) for c in range(32, 127)] + ["\n"]
TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant\n{% endif %}"
)


def write_tiny_tokenizer(directory: Path) -> None:
    """A character-level BPE tokenizer with 3 special tokens; 99 ids in all. Its text is its
    characters side by side (a Fuse decoder), so output text is what the tokens spell."""
    from tokenizers import Tokenizer, decoders, models

    specials = ["<unk>", "<s>", "</s>"]
    vocab = {tok: i for i, tok in enumerate(specials + TINY_CHARS)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "chat_template": TINY_CHAT_TEMPLATE,
                "add_bos_token": False,
            }
        )
    )


def write_tiny_model(
    directory: Path, num_layers: int = 2, hidden_size: int = 64, max_position_embeddings: int = 512
) -> Path:
    """Hugging Face directory of a random Llama (2 layers, hidden 64 and 512 positions unless told;
    vocab 128, GQA 4/2 heads, MLP twice the hidden size)."""
    import transformers

    torch.manual_seed(1234)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
        rms_norm_eps=1e-5,
    )
    model = transformers.LlamaForCausalLM(config)
    # Larger weights than the init default so that logits are spread and greedy output varies.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    model.save_pretrained(directory)
    write_tiny_tokenizer(directory)
    return directory


def write_random_family_model(directory: Path, config_class: str, model_class: str, fields: dict):
    """A Hugging Face directory of a random model of any family transformers knows (its config and
    model class names, and config fields), weights drawn from N(0, 0.2), with the tiny tokenizer;
    returns the transformers model, for reference."""
    import transformers

    torch.manual_seed(7)
    reference = getattr(transformers, model_class)(getattr(transformers, config_class)(**fields)).eval()
    with torch.no_grad():
        for p in reference.parameters():
            p.normal_(0, 0.2)
    reference.save_pretrained(directory)
    write_tiny_tokenizer(directory)
    return reference


def write_layer_skip_draft(target: Path, directory: Path, keep_layers: int = 1) -> Path:
    """A draft model for the model at `target`: its first `keep_layers` layers, embeddings, norm and
    head, with its tokenizer (a layer-skipping self-draft: close to the target, not equal to it)."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(target)
    model.model.layers = model.model.layers[:keep_layers]
    model.config.num_hidden_layers = keep_layers
    model.save_pretrained(directory)
    write_tiny_tokenizer(directory)
    return directory
