"""The harmony parser reads a gpt-oss output into reasoning (the analysis channel), content (the
final channel, a commentary preamble) and tool calls (a message to `functions.NAME`), the same way
however the text is cut into pieces, a marker split across pieces included; an unterminated body is
read to the end; output that does not follow the format is content."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.worker.harmony_parser import HarmonyParser
from shoal.worker.output_events import Arguments, CallStarted, Content

GENERATION_PROMPT = "<|start|>assistant"
ANALYSIS = "<|channel|>analysis<|message|>The user greets me. I greet back.<|end|>"
FINAL = "<|start|>assistant<|channel|>final<|message|>Hello! How can I help?"
ANSWER = ANALYSIS + FINAL + "<|return|>"
CALL = (
    "<|channel|>analysis<|message|>Need the weather.<|end|>"
    "<|start|>assistant<|channel|>commentary<|message|>Let me look.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
    "<|call|>"
)


def read(pieces: list[str], reads_calls: bool = True, opening: str = GENERATION_PROMPT):
    """(reasoning, content, [(name, arguments)], sections) of the output in `pieces`."""
    parser = HarmonyParser(reads_calls, opening)
    outputs = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    events = [event for _, piece_events in outputs for event in piece_events]
    calls: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, CallStarted):
            calls[event.index] = [event.name, ""]
        elif isinstance(event, Arguments):
            calls[event.index][1] += event.text
    content = "".join(event.text for event in events if isinstance(event, Content))
    reasoning = "".join(r for r, _ in outputs)
    return reasoning, content, [tuple(calls[i]) for i in sorted(calls)], parser.sections


def every_cut(text: str) -> list[list[str]]:
    """The text whole, one character a piece, and in two pieces at every position."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


def test_analysis_is_reasoning_and_final_is_content_however_the_text_is_cut():
    for pieces in every_cut(ANSWER):
        assert read(pieces) == (
            "The user greets me. I greet back.",
            "Hello! How can I help?",
            [],
            [(0, len(ANALYSIS))],
        ), pieces


def test_a_call_to_a_function_is_a_tool_call_and_a_commentary_preamble_is_content():
    for pieces in every_cut(CALL):
        assert read(pieces) == (
            "Need the weather.",
            "Let me look.",
            [("get_weather", '{"city":"Paris"}')],
            [(0, CALL.index("<|end|>") + len("<|end|>"))],
        ), pieces
    # The recipient may come before the channel, in the role's part of the header.
    before = (
        "<|channel|>analysis<|message|>x<|end|><|start|>assistant to=functions.f<|channel|>commentary json<|message|>{}"
    )
    assert read([before])[2] == [("f", "{}")]


def test_a_call_is_read_only_when_the_request_reads_calls():
    reasoning, content, calls, _ = read([CALL], reads_calls=False)
    assert (reasoning, content, calls) == ("Need the weather.", 'Let me look.{"city":"Paris"}', [])


def test_an_unterminated_message_is_read_to_the_end():
    for pieces in every_cut("<|channel|>analysis<|message|>Still thinking<|en"):
        assert read(pieces) == ("Still thinking<|en", "", [], [(0, None)])
    assert read([ANALYSIS]) == ("The user greets me. I greet back.", "", [], [(0, len(ANALYSIS))])
    # The generation stopped inside the next header: the cut header is dropped.
    assert read([ANALYSIS + "<|start|>assistant<|chan"])[:2] == ("The user greets me. I greet back.", "")


def test_final_only():
    for pieces in every_cut("<|channel|>final<|message|>Hi.<|return|>"):
        assert read(pieces) == ("", "Hi.", [], [])


def test_output_that_does_not_follow_the_format_is_content_as_written():
    assert read(['{"a": 1}']) == ("", '{"a": 1}', [], [])
    assert read(["hello world"]) == ("", "hello world", [], [])
    assert read(list(ANALYSIS + "\n<b>oops</b>")) == (
        "The user greets me. I greet back.",
        "\n<b>oops</b>",
        [],
        [(0, len(ANALYSIS))],
    )


def test_the_output_continues_the_message_the_prompt_left_open():
    continued = "<|start|>assistant<|channel|>final<|message|>Hel"
    assert read(["lo!<|end|>"], opening=continued) == ("", "lo!", [], [])
    assert read(["hmm<|end|>"], opening="<|start|>assistant<|channel|>analysis<|message|>") == (
        "hmm",
        "",
        [],
        [(0, len("hmm<|end|>"))],
    )
    assert read([ANSWER], opening="")[:2] == ("The user greets me. I greet back.", "Hello! How can I help?")


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_cut_of_the_text_gives_the_same_reading(data):
    text = data.draw(st.sampled_from([ANSWER, CALL, ANALYSIS + "<|start|>assistant<|channel|>final<|message|>a<|e"]))
    cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=12)))
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    assert read(pieces) == read([text])
