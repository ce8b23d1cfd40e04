"""GGUF tokenizers give llama.cpp's token ids and read ids back as text.

Goldens: llama.cpp's ids, recorded by running llama.cpp (tests/support/gguf_tokenizer_goldens.py), for
SentencePiece vocabularies written as llama.cpp's converter writes Llama 2, Phi-3, Gemma 2 and Gemma 3
ones, and for a byte-level BPE with four pre-tokenizers, on texts with whitespace runs, unicode,
emoji, digits, code and special tokens (tests/peers/test_gguf_tokenizer_llama_cpp.py compares with a
live llama.cpp on many more). Also: text round-trips through ids, streaming detokenization, the
SentencePiece merge order, the weight cache's serialization, grammar masks, and refusals.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from shoal.engine.grammar import GrammarCompiler
from shoal.engine.structured_outputs import StructuredOutputs
from shoal.model.errors import ModelLoadError
from shoal.model.llama_vocab import TokenAttr, token_attrs
from shoal.model.special_split import SpecialToken, split_special
from shoal.model.spm_encoder import SpmEncoder
from shoal.model.tokenizer import IncrementalDetokenizer, Tokenizer
from tests.support.gguf_tokenizer_goldens import load
from tests.support.gguf_vocab_files import VocabFile, write_gguf
from tests.support.tokenizer_corpus import SPECIAL_SPELLINGS, random_texts

TEXTS, VOCABULARIES = load()
NAMES = [vocab.name for vocab, _ in VOCABULARIES]
SENTENCEPIECE = [vocab.name for vocab, _ in VOCABULARIES if vocab.metadata["tokenizer.ggml.model"] == "llama"]


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory) -> dict[str, Tokenizer]:
    directory = tmp_path_factory.mktemp("vocabularies")
    return {
        vocab.name: Tokenizer.from_gguf(write_gguf(vocab, directory / f"{vocab.name}.gguf"))
        for vocab, _ in VOCABULARIES
    }


@pytest.mark.parametrize("name", NAMES)
def test_ids_equal_those_llama_cpp_gave(name, tokenizers):
    tokenizer = tokenizers[name]
    [expected] = [ids for vocab, ids in VOCABULARIES if vocab.name == name]
    mismatches = [
        (text, tokenizer.encode(text), ids) for text, ids in zip(TEXTS, expected) if tokenizer.encode(text) != ids
    ]
    assert not mismatches, f"{len(mismatches)} of {len(TEXTS)} texts differ; first: {mismatches[0]}"


def _plain(text: str) -> bool:
    """No special token spelled in it, no U+2581 (which a SentencePiece vocabulary reads as a space)."""
    return "\u2581" not in text and not any(s in text for s in SPECIAL_SPELLINGS + ("<tool>", "<table>", "<|"))


@pytest.mark.parametrize("name", NAMES)
def test_text_comes_back_from_its_ids(name, tokenizers):
    tokenizer = tokenizers[name]
    texts = [t for t in TEXTS + random_texts(300, seed=3, specials=()) if _plain(t)]
    assert len(texts) > 250
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(tokenizer.encode(text)) == text  # a leading BOS dropped with its space prefix


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_streamed_text_equals_decoded_text(name, tokenizers):
    tokenizer = tokenizers[name]
    for text in TEXTS[:40] + random_texts(40, seed=4):
        ids = tokenizer.encode(text)
        for skip in (True, False):
            stream = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip)
            streamed = "".join(stream.add(i) for i in ids) + stream.flush()
            assert streamed == tokenizer.decode(ids, skip), (text, skip)


def test_special_tokens_and_spaces_as_llama_cpp_reads_them(tokenizers):
    gemma, llama, phi3 = tokenizers["gemma2"], tokenizers["llama"], tokenizers["phi3"]
    turn = gemma.encode("<start_of_turn>user\n  hi\t\t<end_of_turn>", add_special_tokens=False)
    pieces = [gemma.backend.id_to_token(i) for i in turn]
    assert pieces[0] == "<start_of_turn>" and pieces[-1] == "<end_of_turn>" and "  " in pieces and "\t\t" in pieces
    assert gemma.decode(turn, skip_special_tokens=False) == "<start_of_turn>user\n  hi\t\t<end_of_turn>"
    assert gemma.decode(turn) == "user\n  hi\t\t"
    assert gemma.eos_token_ids[0] == gemma.backend.token_to_id("<eos>")
    # A space prefix for text that starts the input or follows a special token (Llama 2), none for Gemma.
    assert llama.backend.id_to_token(llama.encode("hello", add_special_tokens=False)[0]).startswith("\u2581")
    assert not gemma.backend.id_to_token(gemma.encode("hello", add_special_tokens=False)[0]).startswith("\u2581")
    # "Phi3": whitespace after a special token is dropped, then the space prefix is put back.
    user = phi3.backend.token_to_id("<|user|>")
    assert phi3.encode("<|user|>   hi", add_special_tokens=False) == [
        user,
        *phi3.encode("hi", add_special_tokens=False),
    ]


def _merged(scores: dict[str, float], text: str) -> list[str]:
    """`text` merged by a vocabulary of its characters (score -100) and the scored pieces."""
    pieces = sorted(set(text)) + list(scores)
    encoder = SpmEncoder({p: i for i, p in enumerate(pieces)}, [scores.get(p, -100.0) for p in pieces], [None] * 256)
    return [pieces[i] for i in encoder.encode(text)]


def test_sentencepiece_merges_the_best_score_first_then_the_leftmost_pair():
    assert _merged({"ab": -1, "bc": -1}, "abc") == ["ab", "c"]  # a tie goes to the leftmost pair
    assert _merged({"ab": -2, "bc": -1}, "abc") == ["a", "bc"]
    assert _merged({"ab": -2, "bc": -1, "abc": -3}, "abc") == ["abc"]  # "a" + "bc" is a pair too
    assert _merged({"ab": -1, "bc": -2, "abc": -3, "cd": -1.5}, "abcd") == ["ab", "cd"]
    encoder = SpmEncoder({"a": 0}, [0.0], list(range(100, 356)))
    assert encoder.encode("aé") == [0, 100 + 0xC3, 100 + 0xA9]  # a character outside the vocabulary: its bytes


@pytest.mark.parametrize("name", SENTENCEPIECE)
def test_cutting_text_where_no_token_spans_changes_no_id(name, tokenizers):
    encoder = tokenizers[name].backend._encoder
    for text in TEXTS + random_texts(200, seed=5):
        escaped = text.replace(" ", "\u2581")
        assert encoder.encode(escaped) == encoder.merge(escaped), text


def test_special_tokens_are_cut_out_longest_first_with_strips():
    specials = [SpecialToken("<ab>", 7, rstrip=True), SpecialToken("<a", 8, lstrip=True), SpecialToken("b", 9)]
    assert split_special("x <ab>  y <a z", specials) == ["x ", 7, "y", 8, " z"]
    assert split_special("bb", specials) == [9, 9]
    assert split_special("", specials) == []


def test_llama_cpp_fixups_of_token_kinds():
    tokens = ["<|im_end|>", "<unused3>", "<|channel|>", "<|user|>", "</s>", "<s>", "word"]
    types = [1, 3, 3, 3, 3, 3, 1]
    attrs = token_attrs({"tokenizer.ggml.token_type": types, "general.name": "Phi 3"}, tokens)
    assert attrs[0] & TokenAttr.CONTROL  # end-of-generation spellings are control tokens
    assert attrs[1] & TokenAttr.UNUSED
    assert attrs[2] == TokenAttr.USER_DEFINED
    assert not attrs[3] & TokenAttr.RSTRIP  # "Phi 3" is not a name llama.cpp matches
    attrs = token_attrs({"tokenizer.ggml.token_type": types, "general.name": "Phi3 mini"}, tokens)
    assert attrs[3] & TokenAttr.RSTRIP and attrs[4] & TokenAttr.RSTRIP and not attrs[5] & TokenAttr.RSTRIP


@pytest.mark.parametrize("name", ["gemma2", "gpt2-llama-bpe"])
def test_the_weight_cache_form_keeps_behaviour(name, tokenizers):
    tokenizer = tokenizers[name]
    again = Tokenizer.from_json(tokenizer.to_json())
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert again.encode(text) == ids
        assert again.decode(ids, skip_special_tokens=False) == tokenizer.decode(ids, skip_special_tokens=False)
    assert again.eos_token_ids == tokenizer.eos_token_ids and again.vocab_size == tokenizer.vocab_size


SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.mark.parametrize(
    ("name", "spec", "text"),
    [
        ("gemma2", StructuredOutputs.from_schema(SCHEMA, "x"), '{"name": "Äpfel 😀 two  words"}'),
        ("gemma3", StructuredOutputs.from_schema(SCHEMA, "x"), r'{"name": "tab\tand  two\n\nlines"}'),
        # A Llama 2 vocabulary puts a space before text that starts the input.
        ("llama", StructuredOutputs(regex=" Äpfel [0-9]+ 😀"), "Äpfel 2024 😀"),
    ],
)
def test_grammar_masks_allow_the_tokens_of_conforming_text(name, spec, text, tokenizers):
    tokenizer = tokenizers[name]
    compiler = GrammarCompiler(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    matcher = compiler.matcher(spec)
    for token in tokenizer.encode(text, add_special_tokens=False):
        [mask], _ = compiler.allowed_tokens([matcher])
        assert mask[token], tokenizer.backend.id_to_token(token)
        assert matcher.consume_token(token)
    assert matcher.is_accepting()


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_encoding_time_grows_about_linearly(name, tokenizers):
    tokenizer = tokenizers[name]
    text = "\n".join(TEXTS) * 4
    started = time.perf_counter()
    tokenizer.encode(text)
    short = time.perf_counter() - started
    started = time.perf_counter()
    tokenizer.encode(text * 8)
    long = time.perf_counter() - started
    assert long < 30 * short + 0.5, (short, long)


def _vocab_file(path: Path, model: str, **metadata) -> Path:
    tokens = ["<unk>", "<s>", "</s>", "a", "b"]
    keys = {
        "tokenizer.ggml.model": model,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [2, 3, 3, 1, 1],
    }
    return write_gguf(VocabFile("x", "llama", {**keys, **metadata}), path)


@pytest.mark.parametrize("kind", ["bert", "t5", "rwkv", "gemma4", "plamo2", "none"])
def test_an_unsupported_tokenizer_model_is_refused_naming_file_and_kind(kind, tmp_path):
    path = _vocab_file(tmp_path / f"{kind}.gguf", kind)
    with pytest.raises(ModelLoadError, match=f"{path}.*{kind!r}.*not supported"):
        Tokenizer.from_gguf(path)


@pytest.mark.parametrize("pre", ["kimi-k2", "no-such-pre"])
def test_an_unknown_pre_tokenizer_is_refused_naming_it(pre, tmp_path):
    path = _vocab_file(tmp_path / "bpe.gguf", "gpt2", **{"tokenizer.ggml.pre": pre, "tokenizer.ggml.merges": ["a b"]})
    with pytest.raises(ModelLoadError, match=f"{path}.*{pre!r}"):
        Tokenizer.from_gguf(path)
