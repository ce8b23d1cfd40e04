"""Splits a model's output into content and tool calls while it streams.

The parser reads one character at a time, so what it yields for a text does not depend on how the
text was cut into pieces: a stream resumed on another worker replays the text the client already
has through a fresh parser and carries on with the same state. Events, in output order:
`Content(text)`, `CallStarted(index, name)` (once the name is known), `Arguments(index, text)`
(fragments whose concatenation is the call's arguments as JSON text).

Invariants: text that might open a call (part of the start marker, or whitespace around calls) is
held back until it is known not to; nothing the model wrote is lost except the markers themselves
and whitespace between calls; a call body that is not a call (malformed JSON, no name) is given
back as content.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from shoal.worker.output_events import Arguments, CallStarted, Content, Event, merged
from shoal.worker.tool_call_format import ToolCallFormat

NAME_OPENING = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")')
ARGUMENTS_OPENING = re.compile(r'\{\s*"name"\s*:\s*"(?:[^"\\]|\\.)*"\s*,\s*"(?:arguments|parameters)"\s*:\s*\{')
# Past this many characters of a call object, its name (or its arguments) did not come first.
OPENING_CHARS = 600


@dataclass
class _CallObject:
    """A call object being read: its text so far, its index once its name is known, and whether its
    arguments (an object that followed the name) are being streamed."""

    text: list[str]
    index: int | None = None
    streaming: bool = False
    streamed: bool = False


class ToolCallParser:
    def __init__(self, fmt: ToolCallFormat):
        self.fmt = fmt
        self.calls = 0  # calls started so far: the next call's index
        self._mode = "content"  # content | body | closing
        self._held = ""  # content held back: a possible start marker, or whitespace
        self._seen_text = False  # non-whitespace content was given out
        self._body: list[str] = []  # raw text of the body being read (given back if malformed)
        self._body_calls = 0  # calls the body being read has started
        self._depth = 0
        self._in_string = False
        self._escaped = False
        self._call: _CallObject | None = None
        self._closing = ""
        self._events: list[Event] = []

    def feed(self, text: str) -> list[Event]:
        for char in text:
            if self._mode == "content":
                self._content_char(char)
            elif self._mode == "body":
                self._body_char(char)
            else:
                self._closing_char(char)
        return self._take()

    def finish(self) -> list[Event]:
        """At the end of the output: held-back text is content (whitespace after calls aside); an
        unfinished body that started no call is content too."""
        if self._mode == "body" and not self._body_calls:
            self._content((self.fmt.start or "") + "".join(self._body))
        elif self._mode == "content" and not self._between_calls(self._held):
            self._content(self._held)
        self._held, self._body, self._mode = "", [], "content"
        return self._take()

    # -- content ------------------------------------------------------------------------------

    def _between_calls(self, held: str) -> bool:
        return bool(self.calls) and held.strip() in ("", ";")

    def _content_char(self, char: str) -> None:
        held = self._held + char
        start = self.fmt.start
        if start is None:
            opening = not self._seen_text or self._between_calls(self._held)
            if opening and char == "{":
                self._open_body()
                self._body_char(char)
            elif opening and (char.isspace() or (self.calls and char == ";")):
                self._held = held
            else:
                self._held = ""
                self._content(held)
            return
        candidate = held.lstrip()
        if not candidate or start.startswith(candidate):
            if candidate == start:
                self._open_body()
            else:
                self._held = held
            return
        keep = _longest_marker_prefix_suffix(held, start)
        self._held = held[len(held) - keep :]
        self._content(held[: len(held) - keep])

    def _content(self, text: str) -> None:
        if text:
            self._seen_text = self._seen_text or not text.isspace()
            self._events.append(Content(text))

    def _open_body(self) -> None:
        """Whitespace held before a call is dropped."""
        self._mode, self._held, self._body, self._body_calls = "body", "", [], 0
        self._depth, self._in_string, self._escaped, self._call = 0, False, False, None

    # -- body: JSON, read structurally --------------------------------------------------------

    def _body_char(self, char: str) -> None:
        self._body.append(char)
        depth_before, was_in_string = self._depth, self._in_string
        self._lex(char)
        structural = not was_in_string and not char.isspace()
        call_depth = 2 if self.fmt.calls_in_array else 1
        if depth_before == 0 and structural and char != ("[" if self.fmt.calls_in_array else "{"):
            self._malformed()
            return
        call = self._call
        if call is None:
            if structural and char == "{" and depth_before == call_depth - 1:
                self._call = _CallObject([char])
            elif structural and depth_before == 1 and char not in ",]":
                self._malformed()
                return
        else:
            call.text.append(char)
            self._advance_call(call, char, depth_before, call_depth)
            if structural and char == "}" and self._depth == call_depth - 1:
                self._end_call(call)
                if self._mode != "body":
                    return
        if structural and self._depth == 0:
            self._end_body()

    def _lex(self, char: str) -> None:
        if self._in_string:
            if self._escaped:
                self._escaped = False
            elif char == "\\":
                self._escaped = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._depth += 1
        elif char in "}]":
            self._depth -= 1

    def _advance_call(self, call: _CallObject, char: str, depth_before: int, call_depth: int) -> None:
        """Starts the call once its name is read; streams its arguments while they are read."""
        if call.streaming:
            if depth_before > call_depth:
                self._events.append(Arguments(call.index, char))
            else:
                call.streaming = False
            return
        if call.streamed or len(call.text) > OPENING_CHARS:
            return
        text = "".join(call.text)
        if call.index is None:
            name = NAME_OPENING.match(text)
            if name:
                self._start_call(call, json.loads(name.group(1)))
        elif ARGUMENTS_OPENING.match(text):
            call.streaming = call.streamed = True
            self._events.append(Arguments(call.index, "{"))

    def _start_call(self, call: _CallObject, name: str) -> None:
        call.index = self.calls
        self.calls += 1
        self._body_calls += 1
        self._events.append(CallStarted(call.index, name))

    def _end_call(self, call: _CallObject) -> None:
        """A whole call object: checked; started and given its arguments if not done as it came."""
        self._call = None
        try:
            value = json.loads("".join(call.text))
        except ValueError:
            value = None
        name = value.get("name") if isinstance(value, dict) else None
        if not isinstance(name, str):
            if call.index is None:
                self._malformed()
            return
        if call.index is None:
            self._start_call(call, name)
        if not call.streamed:
            arguments = value.get(self.fmt.arguments_key, value.get("arguments", value.get("parameters", {})))
            text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            self._events.append(Arguments(call.index, text))

    def _end_body(self) -> None:
        self._body = []
        self._mode, self._closing = ("closing", "") if self.fmt.end else ("content", "")

    def _malformed(self) -> None:
        """The body is not a call: given back as content, unless a call of it already started."""
        if not self._body_calls:
            self._content((self.fmt.start or "") + "".join(self._body))
        self._mode, self._body, self._call, self._in_string = "content", [], None, False

    # -- after a body: the end marker -----------------------------------------------------------

    def _closing_char(self, char: str) -> None:
        self._closing += char
        stripped = self._closing.lstrip()
        if not stripped or self.fmt.end.startswith(stripped):
            if stripped == self.fmt.end:
                self._mode = "content"
            return
        self._mode = "content"  # no end marker: what follows is content
        for held in stripped:
            self._content_char(held)

    def _take(self) -> list[Event]:
        events, self._events = merged(self._events), []
        return events


def _longest_marker_prefix_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
