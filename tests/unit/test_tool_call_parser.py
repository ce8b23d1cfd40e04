"""The tool-call parser reads each format, gives back what is not a call as content, and yields the
same content and calls however the text is cut into pieces (which is what lets a stream resume
on another worker from the text the client has)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from shoal.worker.output_events import Arguments, CallStarted, Content
from shoal.worker.tool_call_format import HERMES, LLAMA3_JSON, MISTRAL, format_for_template
from shoal.worker.tool_call_parser import ToolCallParser

HERMES_TWO_CALLS = (
    "Let me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "nested": [1, {"a": "}{"}], "q": "say \\"hi\\""}}'
    '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


def parse(fmt, pieces: list[str]) -> tuple[str, list[tuple[str, str]], list]:
    parser = ToolCallParser(fmt)
    events = [event for piece in pieces for event in parser.feed(piece)] + parser.finish()
    content = "".join(e.text for e in events if isinstance(e, Content))
    calls: dict[int, list[str]] = {}
    for event in events:
        if isinstance(event, CallStarted):
            calls[event.index] = [event.name, ""]
        elif isinstance(event, Arguments):
            calls[event.index][1] += event.text
    return content, [tuple(calls[i]) for i in sorted(calls)], events


def test_hermes_calls_are_read_with_their_arguments_streamed_after_the_name():
    content, calls, events = parse(HERMES, list(HERMES_TWO_CALLS))
    assert content == "Let me check."
    assert [name for name, _ in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0][1]) == {"city": "Paris", "nested": [1, {"a": "}{"}], "q": 'say "hi"'}
    assert calls[1][1] == "{}"
    kinds = [type(e).__name__ for e in events if not isinstance(e, Content)]
    assert kinds[0] == "CallStarted" and kinds.count("Arguments") > 10  # fragments, one a character here


def test_llama3_and_mistral_formats():
    content, calls, _ = parse(LLAMA3_JSON, [' {"name": "f", "parameters": {"q": 1}}; {"name": "g", "parameters": {}}'])
    assert content == "" and calls == [("f", '{"q": 1}'), ("g", "{}")]
    text = '[TOOL_CALLS][{"name": "f", "arguments": {"q": "x"}}, {"name": "g", "arguments": "{\\"z\\": 2}"}]'
    content, calls, _ = parse(MISTRAL, [text])
    assert content == "" and calls == [("f", '{"q": "x"}'), ("g", '{"z": 2}')]


def test_what_is_not_a_call_stays_content():
    assert parse(HERMES, ["Use <b>bold</b> and <tool"])[:2] == ("Use <b>bold</b> and <tool", [])
    assert parse(HERMES, ["<tool_call>\nnot json\n</tool_call> bye"])[:2] == (
        "<tool_call>\nnot json\n</tool_call> bye",
        [],
    )
    assert parse(HERMES, ['<tool_call>\n{"arguments": {}}\n</tool_call>'])[1] == []
    assert parse(LLAMA3_JSON, ['The answer is {"name": 1}'])[:2] == ('The answer is {"name": 1}', [])
    # Arguments before the name: the call is read whole.
    assert parse(HERMES, ['<tool_call>\n{"arguments": {"x": 1}, "name": "late"}\n</tool_call>'])[1] == [
        ("late", '{"x": 1}')
    ]


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_any_cut_of_the_text_gives_the_same_content_and_calls(data):
    fmt, text = data.draw(
        st.sampled_from(
            [
                (HERMES, HERMES_TWO_CALLS),
                (HERMES, "plain <tool_c text <tool_call>\n{bad"),
                (LLAMA3_JSON, '{"name": "f", "parameters": {"a": [1, 2]}}; {"name": "g", "parameters": {}}'),
                (MISTRAL, '[TOOL_CALLS][{"name": "f", "arguments": {"k": "v,}"}}]'),
            ]
        )
    )
    cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    assert parse(fmt, pieces)[:2] == parse(fmt, [text])[:2]


def test_a_replayed_prefix_leaves_the_parser_where_the_first_one_was():
    """A resumed stream: a new parser fed the text the client had gives the rest identically."""
    for split in range(1, len(HERMES_TWO_CALLS)):
        first = ToolCallParser(HERMES)
        first.feed(HERMES_TWO_CALLS[:split])
        replayed = ToolCallParser(HERMES)
        replayed.feed(HERMES_TWO_CALLS[:split])
        rest = HERMES_TWO_CALLS[split:]
        assert first.feed(rest) + first.finish() == replayed.feed(rest) + replayed.finish()


def test_the_format_is_chosen_from_the_template():
    assert format_for_template("{% if tools %}<tool_call>{% endif %}") is HERMES
    assert format_for_template("[TOOL_CALLS] {{ tools }}") is MISTRAL
    assert format_for_template("<|python_tag|>{{ tools }}") is LLAMA3_JSON
    assert format_for_template(None) is HERMES
