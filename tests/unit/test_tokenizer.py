"""Tokenizer vs transformers' AutoTokenizer (same GGUF / HF dir): ids, text, chat template; streaming detokenization."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import transformers
from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.model.errors import ChatTemplateError
from shoal.model.hf_loader import load_hf_tokenizer
from shoal.model.registry import resolve_model
from shoal.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "Hello, world!",
    "",
    " ",
    "   leading and trailing   ",
    "a\tb\t\tc",
    "line1\nline2\r\nline3\n\n\n",
    "numbers: 0 7 42 1234567890 3.14159 -273.15 1e-9 1,000,000",
    "don't I'M we'll they've she'd",
    "def f(x):\n    return {'k': [x ** 2 for _ in range(10)]}  # comment\n",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>x<|im_end",
    "<|im_start|<|im_end|>|>",
    "café naïve résumé Ångström ß ŝ",
    "e\u0301 combining",
    "日本語のテキストと中文",
    "Здравствуй, мир",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "emoji 😀🚀👍🏽 👨‍👩‍👧‍👦 🇯🇵",
    "🤖" * 5,
    "http://example.com/path?q=1&r=two#frag",
    "tabs\t\t\tand    spaces",
    "MiXeD CaSe WORDS",
    "\u00a0nbsp\u2009thin",
    "x" * 300,
    "1" * 40,
    "\x00\x01 control chars \x7f",
]
MESSAGES = [
    [{"role": "user", "content": "Hi!"}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 😀 in Japanese?"},
    ],
    [{"role": "user", "content": "x", "name": None}],
]


@pytest.fixture(scope="module")
def smollm2_path() -> Path:
    return resolve_model("smollm2-135m-instruct").path


@pytest.fixture(scope="module")
def reference(smollm2_path: Path) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture(scope="module")
def ours(smollm2_path: Path) -> Tokenizer:
    return Tokenizer.from_gguf(smollm2_path)


def test_smollm2_properties(ours: Tokenizer) -> None:
    assert ours.bos_token_id == 1 and ours.eos_token_ids == (2,) and ours.vocab_size == 49152
    assert ours.chat_template is not None and "<|im_start|>" in ours.chat_template
    assert ours.encode("<|im_end|>") == [2] and ours.decode([2]) == "" and ours.decode([2], False) == "<|im_end|>"


@pytest.mark.parametrize("text", TEXTS)
def test_smollm2_encode_decode_match_transformers(ours: Tokenizer, reference, text: str) -> None:
    for special in (True, False):
        ids = ours.encode(text, add_special_tokens=special)
        assert ids == reference.encode(text, add_special_tokens=special)
    for skip in (True, False):
        assert ours.decode(ids, skip_special_tokens=skip) == reference.decode(ids, skip_special_tokens=skip)


# transformers' reading of the GGUF's "smollm" pre-tokenizer splits off decimal digits only; llama.cpp's
# (which shoal follows: tests/peers/test_gguf_tokenizer_llama_cpp.py) splits off every numeral, so
# the two differ where a space precedes another kind of numeral (No, Nl: superscripts, fractions,
# Roman numerals). Random text leaves those out; llama.cpp's own ids for them are checked below.
@settings(max_examples=150, deadline=None)
@given(st.text(st.characters(blacklist_categories=("Cs", "No", "Nl")), max_size=40))
def test_smollm2_random_text_matches_transformers(ours: Tokenizer, reference, text: str) -> None:
    assert ours.encode(text) == reference.encode(text)


def test_smollm2_splits_off_every_numeral_as_llama_cpp_does(ours: Tokenizer) -> None:
    # llama-cpp-python 0.3.36's tokenize() on the bundled GGUF.
    assert ours.encode(" ¹", add_special_tokens=False) == [216, 43183]
    assert ours.encode(" ²3", add_special_tokens=False) == [216, 19133, 35]


@pytest.mark.parametrize("messages", MESSAGES)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(
    ours: Tokenizer, reference, messages, add_generation_prompt: bool
) -> None:
    text = ours.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    assert text == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    ids = reference.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, return_dict=False)
    assert ours.encode(text, add_special_tokens=False) == list(ids)


@pytest.mark.parametrize("opening", ["The capital is", "Sure:\n\n1. ", ""])
def test_a_continued_final_message_renders_as_transformers_renders_it(ours: Tokenizer, reference, opening: str) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Where is Paris?"},
        {"role": "assistant", "content": opening},
    ]
    text = ours.apply_chat_template(messages, add_generation_prompt=False, continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\n" + opening)
    if opening.strip():  # transformers cannot place an empty final message (it finds the content in the text)
        expected = reference.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=False, continue_final_message=True
        )
        assert text == expected or text == expected + opening[len(opening.rstrip()) :]


def test_json_round_trip_preserves_behaviour(ours: Tokenizer) -> None:
    copy = Tokenizer.from_json(ours.to_json())
    assert (copy.bos_token_id, copy.eos_token_ids, copy.vocab_size) == (ours.bos_token_id, ours.eos_token_ids, 49152)
    assert copy.chat_template == ours.chat_template
    assert all(copy.encode(t) == ours.encode(t) for t in TEXTS)


def test_hf_directory_saved_by_transformers_matches(reference, tmp_path: Path) -> None:
    reference.save_pretrained(tmp_path)
    ours = load_hf_tokenizer(tmp_path)
    reloaded = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.eos_token_ids == (2,) and ours.chat_template == reference.chat_template
    for text in TEXTS:
        assert ours.encode(text) == reloaded.encode(text)


def test_chat_template_sandbox_helpers(ours: Tokenizer) -> None:
    backend = ours.backend
    specials = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}
    failing = Tokenizer(backend, special_tokens=specials, chat_template="{{ raise_exception('no system role') }}")
    with pytest.raises(ChatTemplateError, match="no system role"):
        failing.apply_chat_template(MESSAGES[0])
    helpers = (
        "{{ strftime_now('%Y') | length }}|{{ messages | tojson }}|{{ eos_token }}{% generation %}g{% endgeneration %}"
    )
    rendered = Tokenizer(backend, special_tokens=specials, chat_template=helpers).apply_chat_template(
        [{"role": "user", "content": "é<>"}]
    )
    assert rendered == '4|[{"role": "user", "content": "é<>"}]|<|im_end|>g'
    with pytest.raises(ChatTemplateError, match="unsafe"):  # the sandbox is immutable
        Tokenizer(backend, special_tokens=specials, chat_template="{{ messages.append(1) }}").apply_chat_template([])


def _stream(tokenizer: Tokenizer, ids: list[int], prompt: list[int] | None = None, skip: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt, skip_special_tokens=skip)
    return [detok.add(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_deltas_concatenate_to_decode(ours: Tokenizer, text: str) -> None:
    ids = ours.encode(text)
    deltas = _stream(ours, ids)
    assert "".join(deltas) == ours.decode(ids) and deltas[-1] == ""
    assert not any("\ufffd" in d for d in deltas)
    prompt = ours.encode(ours.apply_chat_template(MESSAGES[0]), add_special_tokens=False)
    assert "".join(_stream(ours, ids, prompt=prompt)) == ours.decode(ids)
    assert "".join(_stream(ours, ids, skip=False)) == ours.decode(ids, skip_special_tokens=False)


def test_incremental_detokenizer_holds_back_partial_characters(ours: Tokenizer) -> None:
    ids = ours.encode("🚀")
    assert len(ids) > 1
    deltas = _stream(ours, ids)
    assert deltas[:-2] == [""] * (len(ids) - 1) and deltas[-2] == "🚀"


def test_incremental_detokenizer_on_random_ids(ours: Tokenizer) -> None:
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(ours.vocab_size) if rng.random() < 0.3 else rng.randrange(300) for _ in range(12)]
        for skip in (True, False):
            assert "".join(_stream(ours, ids, skip=skip)) == ours.decode(ids, skip_special_tokens=skip)
