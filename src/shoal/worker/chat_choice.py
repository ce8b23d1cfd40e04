"""One chat choice's generated text as OpenAI message parts: plain content; with a thinking model
(reasoning_use), the reasoning section split off as `reasoning_content`; and, when the request reads
tool calls, `tool_calls` read from the content (streamed as deltas: a call's id, type and name
first, then fragments of its arguments). A harmony model's output (gpt-oss) is read into all three
by one parser (harmony_parser). A request of legacy `functions` gets its one call as
`function_call` (streamed as a name, then fragments of its arguments) and finish reason
"function_call".

Invariant: the deltas of a stream add up to the message of the same text, however the text was cut
into pieces, including a stream resumed elsewhere after `replay` of the text the client had (with
stream_reasoning false, reasoning comes in one delta, which the message has whole too).
"""

from __future__ import annotations

from shoal.worker.output_events import Arguments, CallStarted, Content, Event, merged
from shoal.worker.reasoning_use import ReasoningUse
from shoal.worker.tool_calling import ToolUse, call_id


class ChatChoice:
    def __init__(
        self,
        tool_use: ToolUse | None,
        seed: int,
        prompt_token_ids: list[int],
        reasoning: ReasoningUse | None = None,
        skip_special_tokens: bool = True,
        legacy_functions: bool = False,
    ):
        """`skip_special_tokens`: as the engine decodes this choice's output; `legacy_functions`:
        calls in the legacy function_call shape."""
        self.legacy_functions = legacy_functions
        harmony = reasoning is not None and reasoning.harmony
        self.harmony = reasoning.harmony_parser(tool_use is not None) if harmony else None
        self.parser = tool_use.parser() if tool_use is not None and not harmony else None
        self.thinking = reasoning.parser() if reasoning is not None and not harmony else None
        self.seed = seed
        self.prompt_token_ids = prompt_token_ids
        self.reasoning = reasoning
        self.reasoning_token_count = (
            reasoning.tokens(prompt_token_ids, skip_special_tokens) if reasoning is not None else None
        )
        self._unsent: list[str] = []  # reasoning held for one delta (stream_reasoning false)

    @property
    def parses_text(self) -> bool:
        """Whether the parts sent stand for other text than the raw output (tool calls, reasoning)."""
        return self.parser is not None or self.thinking is not None or self.harmony is not None

    @property
    def calls(self) -> int:
        """Tool calls read so far."""
        reader = self.harmony or self.parser
        return reader.calls if reader is not None else 0

    def tokens(self, token_ids: list[int]) -> None:
        """Takes the choice's next output tokens (for counting its reasoning tokens)."""
        if self.reasoning_token_count is not None:
            self.reasoning_token_count.add(token_ids)

    def reasoning_tokens(self) -> int | None:
        """Output tokens of the reasoning sections so far; None where no reasoning is split off."""
        if self.reasoning_token_count is None:
            return None
        return self.reasoning_token_count.count((self.harmony or self.thinking).sections)

    def replay(self, text: str, token_ids: list[int]) -> None:
        """Takes `token_ids` as generated and their `text` as already sent to the client (a resumed
        stream): the parsers and the reasoning held back for one delta end as they were there."""
        self.tokens(token_ids)
        self.delta(text, final=False)

    def delta(self, text: str, final: bool) -> dict:
        """The message delta for the next piece of text (`final`: the last one)."""
        reasoning, events = self._read(text, final)
        reasoning = self._shown(reasoning, final, streaming=True)
        content, calls = self._parts(events, streaming=True)
        delta = {"reasoning_content": reasoning} if reasoning else {}
        if content:
            delta["content"] = content
        if calls and self.legacy_functions:
            delta["function_call"] = dict(calls[0]["function"])  # one call: parallel_tool_calls is off
        elif calls:
            delta["tool_calls"] = calls
        return delta

    def message(self, text: str) -> dict:
        """The whole assistant message for the whole text (content is null when it has tool calls
        and no text; reasoning_content is there when the output had reasoning to give)."""
        reasoning, events = self._read(text, final=True)
        reasoning = self._shown(reasoning, final=True, streaming=False)
        content, calls = self._parts(events, streaming=False)
        shown = {"reasoning_content": reasoning} if reasoning else {}
        if not calls:
            return {"role": "assistant", "content": content, **shown}
        if self.legacy_functions:
            return {"role": "assistant", "content": content or None, **shown, "function_call": calls[0]["function"]}
        return {"role": "assistant", "content": content or None, **shown, "tool_calls": calls}

    def finish_reason(self, reason: str | None) -> str | None:
        """OpenAI's "tool_calls" (legacy functions: "function_call") for an output that stopped
        after calling tools."""
        if reason != "stop" or not self.calls:
            return reason
        return "function_call" if self.legacy_functions else "tool_calls"

    def _read(self, text: str, final: bool) -> tuple[str, list[Event]]:
        """(reasoning, content and call events) of the next piece of raw text."""
        if self.harmony is not None:
            reasoning, events = self.harmony.feed(text)
            if final:
                more_reasoning, more_events = self.harmony.finish()
                reasoning, events = reasoning + more_reasoning, merged(events + more_events)
            return reasoning, events
        reasoning, content = self.thinking.feed(text) if self.thinking is not None else ("", text)
        if final and self.thinking is not None:
            more_reasoning, more_content = self.thinking.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
        if self.parser is None:
            return reasoning, [Content(content)] if content else []
        return reasoning, self.parser.feed(content) + (self.parser.finish() if final else [])

    def _shown(self, reasoning: str, final: bool, streaming: bool) -> str:
        """The reasoning to send now: none when it is not included; with stream_reasoning false,
        a stream's reasoning is held until its section closes (or the output ends)."""
        if self.reasoning is None or not self.reasoning.include:
            return ""
        if streaming and not self.reasoning.stream:
            self._unsent.append(reasoning)
            reasoning = ""
            if final or not (self.harmony or self.thinking).in_reasoning:
                reasoning, self._unsent = "".join(self._unsent), []
        return reasoning

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
