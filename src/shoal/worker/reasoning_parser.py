"""Splits a thinking model's output into its reasoning section and its answer while it streams.

A reasoning section is the text between a start and an end marker (Qwen3's and SmolLM3's `<think>`
and `</think>`). An output may begin inside one, without the start marker, when the chat template
opened the section in the prompt (Qwen3's thinking models end the generation prompt with
`<think>\\n`): such a parser is made with `opened=True`.

The parser reads one character at a time, so what it gives out for a text does not depend on how
the text was cut into pieces: a stream resumed on another worker replays the text the client
already has through a fresh parser and carries on in the same state. Rules:
- the start marker opens a section only where the output begins (whitespace before it aside):
  an answer that mentions the marker later is content; there is one section at most (an output
  that begins inside one may still write the start marker first, which is dropped);
- the end marker closes the section, and everything after it is content;
- reasoning is the section's text without its leading and trailing whitespace; content is the
  text after the section without its leading whitespace, or the whole output as written where no
  section opened;
- a section that is never closed is reasoning to the end of the output; an output in which no
  section opened (nor its prompt) is content, an end marker in it included.

Invariants: text that may still turn out to be part of a marker, or whitespace that may turn out
to trail the section, is held back until that is known (`finish` decides at the end of the
output); nothing is lost but the markers and that whitespace; `section` is the span of the raw
text the section covers, markers included (end None while it is open), in characters read.
"""

from __future__ import annotations

BEFORE, REASONING, AFTER, CONTENT = "before", "reasoning", "after", "content"


class ReasoningParser:
    def __init__(self, markers: tuple[str, str], opened: bool = False):
        self.start, self.end = markers
        self.opened = opened
        self.state = BEFORE
        self.chars = 0  # characters read
        self.section: tuple[int, int | None] | None = (0, None) if opened else None
        self._held = ""
        self._fresh = True  # no reasoning given out yet: whitespace is leading, and dropped

    @property
    def in_reasoning(self) -> bool:
        """Inside an open section (what comes next is reasoning, unless it closes the section)."""
        return self.state == REASONING or (self.state == BEFORE and self.opened)

    @property
    def sections(self) -> list[tuple[int, int | None]]:
        """The section as a list of spans (none or one), as ReasoningTokens counts them."""
        return [] if self.section is None else [self.section]

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, content) given out for the next piece of the output."""
        reasoning: list[str] = []
        content: list[str] = []
        for char in text:
            self.chars += 1
            if self.state == BEFORE:
                self._before(char, reasoning, content)
            elif self.state == REASONING:
                self._reasoning(char, reasoning)
            elif self.state == AFTER:
                if not char.isspace():
                    self.state = CONTENT
                    content.append(char)
            else:
                content.append(char)
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """(reasoning, content) held back at the end of the output: before any section, all of it
        is content; in an open section, it is reasoning unless it is only trailing whitespace."""
        held, self._held = self._held, ""
        if self.state == BEFORE and not self.opened:
            self.state = CONTENT
            return "", held
        if self.in_reasoning and held.strip():
            return held.lstrip() if self._fresh else held, ""
        return "", ""

    def _before(self, char: str, reasoning: list[str], content: list[str]) -> None:
        held = self._held + char
        opening = held.lstrip()
        if opening == self.start:
            self.state, self._held = REASONING, ""
            if not self.opened:
                self.section = (self.chars - len(self.start), None)
        elif self.start.startswith(opening):
            self._held = held
        elif self.opened:
            self.state, self._held = REASONING, ""
            for held_char in held:
                self._reasoning(held_char, reasoning)
        else:
            self.state, self._held = CONTENT, ""
            content.append(held)

    def _reasoning(self, char: str, reasoning: list[str]) -> None:
        if self._fresh and not self._held and char.isspace():
            return
        held = self._held + char
        if held.lstrip() == self.end:
            self.state, self._held = AFTER, ""
            self.section = (self.section[0], self.chars)
            return
        keep = _held_suffix(held, self.end)
        given = held[: len(held) - keep]
        self._held = held[len(held) - keep :]
        if given:
            self._fresh = False
            reasoning.append(given)


def _held_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is whitespace followed by a proper prefix of
    `marker` (either part may be empty)."""
    for begin in range(len(text)):
        core = text[begin:].lstrip()
        if len(core) < len(marker) and marker.startswith(core):
            return len(text) - begin
    return 0
