"""Stop tokens, stop strings, min/max tokens and streamed text deltas."""

from __future__ import annotations

import pytest

from shoal.engine.output_stream import OutputStream
from shoal.engine.sampler import SampledToken
from shoal.engine.sampling_params import SamplingParams
from shoal.model.registry import resolve_model
from shoal.model.tokenizer import Tokenizer

EOS = 2


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(resolve_model("smollm2-135m-instruct").path)


def feed(tokenizer, params, text) -> tuple[OutputStream, list[str]]:
    stream = OutputStream(tokenizer, params, [1, 2, 3], (EOS,), max_model_len=1000)
    deltas = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        stream.append(SampledToken(token))
        deltas.append(stream.take_new_text())
        if stream.finish_reason:
            break
    return stream, deltas


def test_deltas_concatenate_to_the_text(tokenizer):
    stream, deltas = feed(tokenizer, SamplingParams(max_tokens=100), "Héllo wörld, 你好 👋 done")
    assert "".join(deltas) == stream.text == "Héllo wörld, 你好 👋 done"
    assert stream.finish_reason is None


def test_stop_string_truncates_and_is_never_streamed(tokenizer):
    stream, deltas = feed(tokenizer, SamplingParams(max_tokens=100, stop=["END", "zzz"]), "alpha beta ENDING gamma")
    assert stream.finish_reason == "stop" and stream.stop_reason == "END"
    assert stream.text == "alpha beta " and "".join(deltas) == "alpha beta "


def test_include_stop_string(tokenizer):
    stream, _ = feed(
        tokenizer, SamplingParams(max_tokens=100, stop=["beta"], include_stop_str_in_output=True), "alpha beta gamma"
    )
    assert stream.text == "alpha beta"


def test_stop_token_and_eos(tokenizer):
    stream = OutputStream(tokenizer, SamplingParams(stop_token_ids=[42]), [1], (EOS,), 1000)
    stream.append(SampledToken(42))
    assert (stream.finish_reason, stream.stop_reason) == ("stop", 42)
    ignoring = OutputStream(tokenizer, SamplingParams(ignore_eos=True, max_tokens=5), [1], (EOS,), 1000)
    ignoring.append(SampledToken(EOS))
    assert ignoring.finish_reason is None


def test_min_tokens_bans_stop_tokens_until_reached(tokenizer):
    stream = OutputStream(tokenizer, SamplingParams(min_tokens=2, max_tokens=5), [1], (EOS,), 1000)
    assert stream.banned_token_ids() == (EOS,)
    stream.append(SampledToken(100))
    stream.append(SampledToken(101))
    assert stream.banned_token_ids() == ()


def test_length_limits(tokenizer):
    stream = OutputStream(tokenizer, SamplingParams(max_tokens=2), [1], (EOS,), 1000)
    stream.append(SampledToken(100))
    assert stream.finish_reason is None
    stream.append(SampledToken(101))
    assert stream.finish_reason == "length"
    window = OutputStream(tokenizer, SamplingParams(max_tokens=50), [1, 2, 3], (EOS,), max_model_len=4)
    window.append(SampledToken(100))
    assert window.finish_reason == "length"
