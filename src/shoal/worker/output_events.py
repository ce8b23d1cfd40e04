"""What the readers of a chat choice's output give out, in output order: `Content(text)`,
`CallStarted(index, name)` (once a tool call's name is known) and `Arguments(index, text)`
(fragments whose concatenation is the call's arguments as JSON text)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Content:
    text: str


@dataclass(frozen=True)
class CallStarted:
    index: int
    name: str


@dataclass(frozen=True)
class Arguments:
    index: int
    text: str


Event = Content | CallStarted | Arguments


def merged(events: list[Event]) -> list[Event]:
    """Adjacent content, and adjacent argument fragments of one call, as one event each."""
    out: list[Event] = []
    for event in events:
        last = out[-1] if out else None
        if isinstance(event, Content) and isinstance(last, Content):
            out[-1] = Content(last.text + event.text)
        elif isinstance(event, Arguments) and isinstance(last, Arguments) and last.index == event.index:
            out[-1] = Arguments(event.index, last.text + event.text)
        else:
            out.append(event)
    return out
