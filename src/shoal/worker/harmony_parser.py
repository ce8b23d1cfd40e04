"""Reads a gpt-oss model's output, written in OpenAI's harmony format, into reasoning, content and
tool calls while it streams.

The output is a sequence of messages, each a header, `<|message|>`, a body and a terminator:
`<|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>...<|return|>`.
A header names the message's channel (`<|channel|>analysis`) and may name a recipient
(`to=functions.get_weather`, before or after the channel) and a content type (`<|constrain|>json`).
The first message's header continues the prompt (which ends with `<|start|>assistant`); the next
ones follow `<|start|>`. Bodies end at `<|end|>`, `<|return|>` or `<|call|>` (the last two end the
generation, so they are usually stop tokens, absent from the text), or at the end of the output.
The markers are special tokens: the text read must keep them.

A body goes where vLLM sends it: to a served tool call when its recipient is `functions.NAME` and
the request reads tool calls (`CallStarted` at its header, then `Arguments`, the body as written);
else by channel: `analysis` is reasoning, any other channel (`final`, a `commentary` preamble) or
none is content.

The parser reads one character at a time, so what it gives out for a text does not depend on how
the text was cut into pieces; a stream resumed on another worker replays the text the client had
through a fresh parser and carries on in the same state. Invariants: a header is held until its
`<|message|>` (it is not given out); text that may be part of a terminator is held until that is
known; an output that stops following the format (a header with a character no header has, or
longer than MAX_HEADER_CHARS) is content from the start of that message on, as written; nothing
else is lost but markers and headers. `sections` are the spans of the reasoning messages, markers
included, in characters read (a message still open ends None).
"""

from __future__ import annotations

import re

from shoal.worker.output_events import Arguments, CallStarted, Content, Event, merged

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
TERMINATORS = ("<|end|>", "<|return|>", "<|call|>")
MAX_HEADER_CHARS = 256
FUNCTIONS = "functions."
_HEADER_TEXT = re.compile(r"[A-Za-z0-9_.:=/\- ]*")
_RECIPIENT = re.compile(r"(?<![A-Za-z0-9_])to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"([^\s<]+)")

BETWEEN, HEADER, BODY, PLAIN = "between", "header", "body", "plain"


class HarmonyParser:
    def __init__(self, reads_calls: bool, opening: str = ""):
        """`reads_calls`: messages to `functions.NAME` are tool calls. `opening`: the prompt's
        last message as far as it goes (from its last `<|start|>`), which the output continues:
        `<|start|>assistant` after a generation prompt."""
        self.reads_calls = reads_calls
        self.calls = 0  # calls started so far: the next call's index
        self.sections: list[tuple[int, int | None]] = []
        self.chars = -len(opening)  # characters read, counted from the output's start
        self._state = BETWEEN
        self._held = ""  # a possible marker, or the header so far
        self._raw = ""  # the output's text since its message began (given back if it stops following the format)
        self._start = 0  # where the current message began
        self._kind = "content"  # of the current body: reasoning | content | call
        self.feed(opening)
        self._raw = ""

    @property
    def in_reasoning(self) -> bool:
        """Inside a reasoning message's body."""
        return self._state == BODY and self._kind == "reasoning"

    def feed(self, text: str) -> tuple[str, list[Event]]:
        """(reasoning, content and call events) given out for the next piece of the output."""
        reasoning: list[str] = []
        events: list[Event] = []
        for char in text:
            self.chars += 1
            if self._state == PLAIN:
                events.append(Content(char))
                continue
            if self._state != BODY:
                self._raw += char
            if self._state == BETWEEN:
                self._between(char, events)
            elif self._state == HEADER:
                self._header(char, events)
            else:
                self._body(char, reasoning, events)
        return "".join(reasoning), merged(events)

    def finish(self) -> tuple[str, list[Event]]:
        """What is held at the end of the output: a body's text goes where its body does; an
        unfinished header is dropped where it has a marker (the format cut short), and is content
        as written where it has none (an output that never followed the format)."""
        held, self._held = self._held, ""
        reasoning: list[str] = []
        events: list[Event] = []
        if self._state == BODY:
            self._give(held, reasoning, events)
        elif self._state == HEADER and self._raw and not any(m in self._raw for m in (START, CHANNEL, CONSTRAIN)):
            events.append(Content(self._raw))
        self._state, self._raw = PLAIN, ""
        return "".join(reasoning), events

    def _between(self, char: str, events: list[Event]) -> None:
        """After a terminator (or at the start): `<|start|>` opens the next header; a header may
        also come straight away, as the first one does; whitespace between messages is dropped."""
        held = self._held + char
        if START.startswith(held):
            self._held = held if held != START else ""
            if held == START:
                self._state = HEADER
            return
        if held.isspace():
            self._held = ""
        else:
            self._state, self._held = HEADER, held[:-1]
            self._header(char, events)

    def _header(self, char: str, events: list[Event]) -> None:
        header = self._held + char
        if header.endswith(MESSAGE):
            self._held = ""
            self._open(header[: -len(MESSAGE)], events)
        elif _could_be_header(header):
            self._held = header
        else:
            self._state, self._held = PLAIN, ""
            events.append(Content(self._raw))

    def _open(self, header: str, events: list[Event]) -> None:
        """The body begins: where it goes is read from its header."""
        self._state, self._raw = BODY, ""
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        name = recipient.group(1) if recipient else ""
        if self.reads_calls and name.startswith(FUNCTIONS) and len(name) > len(FUNCTIONS):
            self._kind = "call"
            events.append(CallStarted(self.calls, name[len(FUNCTIONS) :]))
            self.calls += 1
        elif channel and channel.group(1) == "analysis":
            self._kind = "reasoning"
            self.sections.append((max(self._start, 0), None))
        else:
            self._kind = "content"

    def _body(self, char: str, reasoning: list[str], events: list[Event]) -> None:
        held = self._held + char
        if held in TERMINATORS:
            self._held = ""
            if self._kind == "reasoning":
                self.sections[-1] = (self.sections[-1][0], self.chars)
            self._state, self._raw, self._start = BETWEEN, "", self.chars
            return
        keep = _marker_prefix_suffix(held)
        self._held = held[len(held) - keep :]
        self._give(held[: len(held) - keep], reasoning, events)

    def _give(self, text: str, reasoning: list[str], events: list[Event]) -> None:
        if not text:
            return
        if self._kind == "reasoning":
            reasoning.append(text)
        elif self._kind == "call":
            events.append(Arguments(self.calls - 1, text))
        else:
            events.append(Content(text))


def _could_be_header(text: str) -> bool:
    """Whether `text` may still become a header: its channel and constrain markers aside, only the
    characters of roles, channels, recipients and content types, and maybe the beginning of a
    marker at its end."""
    if len(text) > MAX_HEADER_CHARS:
        return False
    bare = text.replace(CHANNEL, " ").replace(CONSTRAIN, " ")
    cut = bare.rfind("<")
    if cut >= 0 and any(marker.startswith(bare[cut:]) for marker in (CHANNEL, CONSTRAIN, MESSAGE)):
        bare = bare[:cut]
    return _HEADER_TEXT.fullmatch(bare) is not None


def _marker_prefix_suffix(text: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a terminator."""
    for length in range(min(len(text), max(map(len, TERMINATORS)) - 1), 0, -1):
        if any(marker.startswith(text[-length:]) for marker in TERMINATORS):
            return length
    return 0
