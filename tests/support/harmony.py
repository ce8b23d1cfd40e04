"""The tiny character-level tokenizer with harmony's special tokens added (`<|start|>`, `<|channel|>`,
...), as gpt-oss's o200k_harmony has them, and `<|return|>` as its end of sequence; for gpt-oss
models and the harmony tests."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.tiny_model import write_tiny_tokenizer

HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>")


def write_harmony_tokenizer(directory: Path, chat_template: str | None = None) -> dict[str, int]:
    """Writes the tokenizer (with `chat_template`, or none, so a gpt-oss model gets its family's);
    returns each harmony token's id."""
    from tokenizers import Tokenizer

    write_tiny_tokenizer(directory)
    backend = Tokenizer.from_file(str(directory / "tokenizer.json"))
    backend.add_special_tokens(list(HARMONY_TOKENS))
    backend.save(str(directory / "tokenizer.json"))
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings["eos_token"] = "<|return|>"
    settings.pop("chat_template")
    if chat_template is not None:
        settings["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return {token: backend.token_to_id(token) for token in HARMONY_TOKENS}
