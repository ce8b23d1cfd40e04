"""A model file without a chat template chats with its family's, and says so; one with a template
keeps its own."""

from __future__ import annotations

import json
import logging
import shutil

from shoal.model.loader import load_checkpoint

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]


def test_a_file_without_a_template_gets_its_familys_and_a_log_line(tiny_model_dir, tmp_path, caplog):
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model_dir, bare)
    settings = json.loads((bare / "tokenizer_config.json").read_text())
    settings.pop("chat_template")
    (bare / "tokenizer_config.json").write_text(json.dumps(settings))
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    with caplog.at_level(logging.INFO, logger="shoal.model.loader"):
        tokenizer = load_checkpoint(str(bare), cache_dir=tmp_path / "cache").tokenizer
    assert tokenizer.apply_chat_template(MESSAGES) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert any("has no chat template: using the llama family's default" in r.getMessage() for r in caplog.records)


def test_a_file_with_a_template_keeps_it(tiny_model_dir, tmp_path):
    tokenizer = load_checkpoint(str(tiny_model_dir), cache_dir=tmp_path / "cache").tokenizer
    assert "<|im_start|>" not in tokenizer.apply_chat_template(MESSAGES)


def test_gemmas_template_has_model_turns_and_folds_the_system_message_into_the_first_user_turn():
    from shoal.model.chat_template import compile_chat_template, render_chat_template
    from shoal.model.families.chat_templates import GEMMA

    turns = [*MESSAGES, {"role": "assistant", "content": " Hello. "}, {"role": "user", "content": "Bye"}]
    template = compile_chat_template(GEMMA)
    text = render_chat_template(
        template, turns, add_generation_prompt=True, tools=None, special_tokens={"bos_token": "<bos>"}
    )
    assert text == (
        "<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
        "<start_of_turn>user\nBye<end_of_turn>\n<start_of_turn>model\n"
    )


TURNS = [*MESSAGES, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}]
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>"}


def render(template_text: str) -> str:
    from shoal.model.chat_template import compile_chat_template, render_chat_template

    template = compile_chat_template(template_text)
    return render_chat_template(template, TURNS, add_generation_prompt=True, tools=None, special_tokens=SPECIAL)


def test_phi3s_granites_olmo2s_and_mistrals_templates_render_their_models_turns():
    from shoal.model.families.chat_templates import GRANITE, MISTRAL, OLMO2, PHI3

    assert render(PHI3) == (
        "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\nHello.<|end|>\n<|user|>\nBye<|end|>\n"
        "<|assistant|>\n"
    )
    assert render(GRANITE) == (
        "<|start_of_role|>system<|end_of_role|>Be brief.<|end_of_text|>\n"
        "<|start_of_role|>user<|end_of_role|>Hi<|end_of_text|>\n"
        "<|start_of_role|>assistant<|end_of_role|>Hello.<|end_of_text|>\n"
        "<|start_of_role|>user<|end_of_role|>Bye<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>"
    )
    assert render(OLMO2) == (
        "<s><|system|>\nBe brief.\n<|user|>\nHi\n<|assistant|>\nHello.</s>\n<|user|>\nBye\n<|assistant|>\n"
    )
    assert render(MISTRAL) == "<s>[INST] Be brief.\n\nHi [/INST]Hello.</s>[INST] Bye [/INST]"


def test_every_family_chats_without_a_template_of_its_own():
    from shoal.model.families import FAMILIES

    assert [f.name for f in FAMILIES if f.chat_template is None] == []
