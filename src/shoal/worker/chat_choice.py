"""One chat choice's generated text as OpenAI message parts: plain content, or, when the request
reads tool calls, content and `tool_calls` (streamed as deltas: a call's id, type and name first,
then fragments of its arguments).

Invariant: the deltas of a stream add up to the message of the same text, however the text was cut
into pieces, including a stream resumed elsewhere after `replay` of the text the client had.
"""

from __future__ import annotations

from shoal.worker.tool_call_parser import Arguments, CallStarted, Content, Event
from shoal.worker.tool_calling import ToolUse, call_id


class ChatChoice:
    def __init__(self, tool_use: ToolUse | None, seed: int, prompt_token_ids: list[int]):
        self.parser = tool_use.parser() if tool_use is not None else None
        self.seed = seed
        self.prompt_token_ids = prompt_token_ids

    @property
    def reads_tool_calls(self) -> bool:
        return self.parser is not None

    def replay(self, text: str) -> None:
        """Takes `text` as already sent to the client (a resumed stream)."""
        if self.parser is not None:
            self.parser.feed(text)

    def delta(self, text: str, final: bool) -> dict:
        """The message delta for the next piece of text (`final`: the last one)."""
        if self.parser is None:
            return {"content": text} if text else {}
        events = self.parser.feed(text) + (self.parser.finish() if final else [])
        content, calls = self._parts(events, streaming=True)
        delta = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = calls
        return delta

    def message(self, text: str) -> dict:
        """The whole assistant message for the whole text (content is null when it has tool calls
        and no text)."""
        if self.parser is None:
            return {"role": "assistant", "content": text}
        content, calls = self._parts(self.parser.feed(text) + self.parser.finish(), streaming=False)
        if not calls:
            return {"role": "assistant", "content": content}
        return {"role": "assistant", "content": content or None, "tool_calls": calls}

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" for an output that stopped after calling tools."""
        return "tool_calls" if reason == "stop" and self.parser is not None and self.parser.calls else reason

    def _parts(self, events: list[Event], streaming: bool) -> tuple[str, list[dict]]:
        content = "".join(event.text for event in events if isinstance(event, Content))
        calls: dict[int, dict] = {}
        for event in events:
            if isinstance(event, CallStarted):
                calls[event.index] = {
                    **({"index": event.index} if streaming else {}),
                    "id": call_id(self.seed, self.prompt_token_ids, event.index),
                    "type": "function",
                    "function": {"name": event.name, "arguments": ""},
                }
            elif isinstance(event, Arguments):
                call = calls.setdefault(event.index, {"index": event.index, "function": {"arguments": ""}})
                call["function"]["arguments"] += event.text
        return content, [calls[index] for index in sorted(calls)]
