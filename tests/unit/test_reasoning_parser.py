"""The reasoning parser splits a thinking model's output into reasoning and content the same way
however the text is cut into pieces (a marker split across deltas included), with or without the
start marker, with or without the end marker; and reasoning tokens are counted from each token's
own text."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.model.hf_loader import load_hf_tokenizer
from shoal.worker.reasoning_parser import ReasoningParser
from shoal.worker.reasoning_tokens import ReasoningTokens
from tests.support.tiny_model import write_tiny_tokenizer

THINK = ("<think>", "</think>")


def split(pieces: list[str], opened: bool = False) -> tuple[str, str, list[tuple[str, str]], tuple | None]:
    """(reasoning, content, each piece's output, the section's span) of the output in `pieces`."""
    parser = ReasoningParser(THINK, opened=opened)
    outputs = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    return "".join(r for r, _ in outputs), "".join(c for _, c in outputs), outputs, parser.section


def every_cut(text: str) -> list[list[str]]:
    """The text whole, one character a piece, and in two pieces at every position."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


QWEN3 = "<think>\nThe user greets me.\nI greet back.\n</think>\n\nHello! How can I help?"


def test_a_section_and_its_answer_are_split_however_the_text_is_cut():
    for pieces in every_cut(QWEN3):
        reasoning, content, _, section = split(pieces)
        assert reasoning == "The user greets me.\nI greet back."
        assert content == "Hello! How can I help?"
        assert section == (0, QWEN3.index("</think>") + len("</think>"))


def test_a_marker_split_across_deltas_is_held_back_until_it_is_whole():
    reasoning, content, outputs, _ = split(["<thi", "nk>abc</th", "ink>xyz"])
    assert (reasoning, content) == ("abc", "xyz")
    assert outputs[0] == ("", "")  # "<thi" may open a section: nothing is given out yet
    assert outputs[1] == ("abc", "")  # "</th" may close it: held back
    assert outputs[2] == ("", "xyz")


def test_text_that_only_looks_like_a_marker_is_given_back():
    assert split(list("<think>a </thinker> b</think>c"))[:2] == ("a </thinker> b", "c")
    assert split(list("<thinking> aloud"))[:2] == ("", "<thinking> aloud")


def test_output_that_begins_inside_a_section_the_prompt_opened():
    for pieces in every_cut("The user greets me.</think>\n\nHello!"):
        reasoning, content, _, section = split(pieces, opened=True)
        assert (reasoning, content) == ("The user greets me.", "Hello!")
        assert section == (0, len("The user greets me.</think>"))
    # A start marker written anyway, right at the start, is dropped.
    assert split(list("<think>\nhm</think>ok"), opened=True)[:2] == ("hm", "ok")


def test_without_an_end_marker_the_output_is_reasoning_if_a_section_opened_else_content():
    assert split(list("<think>still thinking \n"))[:2] == ("still thinking", "")
    assert split(list("still thinking"), opened=True)[:2] == ("still thinking", "")
    assert split(list("a plain answer"))[:2] == ("", "a plain answer")
    # An end marker with no section open is text, like any other.
    assert split(list("a plain</think>answer"))[:2] == ("", "a plain</think>answer")
    # A held partial marker is given back at the end, where it belongs.
    assert split(list("<think>ab</thi"))[:2] == ("ab</thi", "")
    assert split(list("  <thin"))[:2] == ("", "  <thin")


def test_the_start_marker_opens_a_section_only_where_the_output_begins():
    reasoning, content, _, section = split(list("  \n<think>x</think>y"))
    assert (reasoning, content, section) == ("x", "y", (3, 19))
    text = "Sure. <think>is a tag</think>"
    assert split(list(text))[:2] == ("", text)
    # After the section, markers are content too.
    assert split(list("<think>a</think>b<think>c</think>"))[:2] == ("a", "b<think>c</think>")


def test_an_empty_section_gives_no_reasoning():
    reasoning, content, outputs, _ = split(list("<think>\n\n</think>\n\nAnswer."))
    assert (reasoning, content) == ("", "Answer.")
    assert all(r == "" for r, _ in outputs)


PIECES = ["<think>", "</think>", "<", "</", "<th", "think", ">", "a", "b c", " ", "\n"]


def kept_text(text: str, opened: bool, section: tuple | None) -> str:
    """`text` without the markers the parser took for the section's."""
    kept = text
    if section is not None:
        start, end = section
        if end is not None:
            kept = kept[: end - len("</think>")] + kept[end:]
        if opened:  # a start marker written anyway where the output begins
            start = len(text) - len(text.lstrip()) if text.lstrip().startswith("<think>") else None
        if start is not None:
            kept = kept[:start] + kept[start + len("<think>") :]
    return kept


def test_every_short_output_splits_the_same_at_every_cut_and_loses_only_markers_and_whitespace():
    for size in (1, 2, 3):
        for words in itertools.product(PIECES, repeat=size):
            text = "".join(words)
            for opened in (False, True):
                reasoning, content, _, section = split([text], opened)
                for pieces in every_cut(text):
                    assert split(pieces, opened)[::3] == (reasoning, section), (text, opened, pieces)
                    assert split(pieces, opened)[1] == content, (text, opened, pieces)
                assert "".join((reasoning + content).split()) == "".join(kept_text(text, opened, section).split())


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.sampled_from(PIECES), max_size=14),
    st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=40),
    st.booleans(),
)
def test_any_cut_gives_what_one_character_at_a_time_gives(words, cuts, opened):
    text = "".join(words)
    pieces, at = [], 0
    for cut in cuts * (len(text) + 1):
        if at >= len(text):
            break
        pieces.append(text[at : at + cut])
        at += cut
    reasoning, content, _, section = split([text], opened)
    assert split(pieces, opened)[:2] == split(list(text), opened)[:2] == (reasoning, content)
    assert split(pieces, opened)[3] == split(list(text), opened)[3] == section
    # Nothing is lost but the markers of the section and whitespace.
    assert "".join((reasoning + content).split()) == "".join(kept_text(text, opened, section).split())


def test_reasoning_tokens_are_those_whose_text_lies_in_the_section(tmp_path):
    write_tiny_tokenizer(tmp_path)
    tokenizer = load_hf_tokenizer(tmp_path)  # one token a character
    text = "<think>abc</think>xyz"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)
    counter = ReasoningTokens(tokenizer, tokenizer.encode("hi", add_special_tokens=False), skip_special_tokens=True)
    counter.add(ids[:5])
    counter.add(ids[5:])
    assert counter.count([split([text])[3]]) == len("<think>abc</think>")
    opened = ReasoningTokens(tokenizer, [], skip_special_tokens=True)
    opened.add(tokenizer.encode("abc</think>xyz", add_special_tokens=False))
    assert opened.count([split(["abc</think>xyz"], opened=True)[3]]) == len("abc</think>")
    assert opened.count([]) == 0
    unclosed = ReasoningTokens(tokenizer, [], skip_special_tokens=True)
    unclosed.add(tokenizer.encode("<think>ab", add_special_tokens=False))
    assert unclosed.count([split(["<think>ab"])[3]]) == len("<think>ab")
