"""Turns the chat completion stream of a message into the Messages API's server-sent events:
message_start and a ping, then content blocks (content_block_start, content_block_delta with
thinking_delta, text_delta or input_json_delta, content_block_stop), then message_delta (stop
reason and usage) and message_stop; or an `error` event in Anthropic's shape.

When the chat stream is journaled (its events carry `event_id`s), the last event made from each
chat event gets an SSE id: the chat event's id, `#`, and where the content blocks stood after it
(MessagesPosition). A client that reconnects with that Last-Event-ID gets the rest of the same
message: the chat stream resumes from its id, and the blocks go on from where they stood."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

from shoal.protocol.sse import json_events, named_event
from shoal.router.messages_api.errors import error_body
from shoal.router.messages_api.message_object import (
    message_skeleton,
    stop_reason,
    thinking_block,
    tool_use_block,
    usage,
)
from shoal.router.placement.route_request import RequestError

BLOCK_KINDS = ("thinking", "text", "tool_use")


@dataclass(frozen=True)
class MessagesPosition:
    """Where a client stands in a journaled Messages stream: the chat event it last got the
    translation of, and the content blocks then (how many opened, the open one, the tool calls
    seen). Written as CHAT_EVENT_ID#OPENED.KIND.INDEX.CALLS (KIND "-" when no block is open, CALLS
    comma-separated)."""

    chat_event_id: str
    opened: int
    current: tuple[str, int] | None
    calls: tuple[int, ...]

    def __str__(self) -> str:
        kind, index = self.current or ("-", 0)
        return f"{self.chat_event_id}#{self.opened}.{kind}.{index}.{','.join(map(str, self.calls))}"

    @classmethod
    def parse(cls, raw: str) -> MessagesPosition:
        """RequestError (naming Last-Event-ID) for anything this stream did not write."""
        chat_event_id, _, blocks = raw.strip().rpartition("#")
        parts = blocks.split(".")
        try:
            opened, kind, index, calls = int(parts[0]), parts[1], int(parts[2]), parts[3]
            call_indexes = tuple(int(c) for c in calls.split(",")) if calls else ()
        except (ValueError, IndexError):
            raise RequestError(
                f"Last-Event-ID {raw!r} is not an event id of a Messages stream", "Last-Event-ID"
            ) from None
        if not chat_event_id or len(parts) != 4 or kind not in ("-", *BLOCK_KINDS) or opened < 0:
            raise RequestError(f"Last-Event-ID {raw!r} is not an event id of a Messages stream", "Last-Event-ID")
        return cls(chat_event_id, opened, None if kind == "-" else (kind, index), call_indexes)


class _Blocks:
    """The message's content blocks as the chat stream brings them. Invariants: at most one block
    is open, and a block closes before the next opens; indexes count from 0 in opening order; a
    run of reasoning is one thinking block, a run of text one text block, and each tool call one
    tool_use block, opened by the call's first delta (which names it)."""

    def __init__(self, event: Callable[..., bytes], position: MessagesPosition | None = None):
        self.event = event
        self.opened = position.opened if position else 0
        self.current: tuple[str, int] | None = position.current if position else None
        self.calls: set[int] = set(position.calls) if position else set()

    def position(self, chat_event_id: str) -> MessagesPosition:
        return MessagesPosition(chat_event_id, self.opened, self.current, tuple(sorted(self.calls)))

    def thinking(self, text: str) -> list[bytes]:
        events = self._open(("thinking", 0), thinking_block(""))
        return [*events, self._delta({"type": "thinking_delta", "thinking": text})]

    def text(self, text: str) -> list[bytes]:
        events = self._open(("text", 0), {"type": "text", "text": ""})
        return [*events, self._delta({"type": "text_delta", "text": text})]

    def call(self, delta: dict) -> list[bytes]:
        """Raises ValueError for a delta of a call whose block has closed (the worker streams
        calls one after another, so this is a broken stream)."""
        index, function = delta.get("index", 0), delta.get("function") or {}
        events = []
        if self.current != ("tool_use", index):
            if index in self.calls:
                raise ValueError(f"tool call {index} went on after the next block began")
            self.calls.add(index)
            events = self._open(("tool_use", index), tool_use_block(delta.get("id"), function.get("name"), None))
        if function.get("arguments"):
            events.append(self._delta({"type": "input_json_delta", "partial_json": function["arguments"]}))
        return events

    def close(self) -> list[bytes]:
        if self.current is None:
            return []
        self.current = None
        return [self.event("content_block_stop", index=self.opened - 1)]

    def _open(self, key: tuple[str, int], block: dict) -> list[bytes]:
        if self.current == key:
            return []
        events = self.close()
        self.current = key
        self.opened += 1
        return [*events, self.event("content_block_start", index=self.opened - 1, content_block=block)]

    def _delta(self, delta: dict) -> bytes:
        return self.event("content_block_delta", index=self.opened - 1, delta=delta)


async def message_events(
    chat_chunks: AsyncGenerator[bytes, None], message_id: str, model: str, resumed: MessagesPosition | None = None
) -> AsyncIterator[bytes]:
    """Invariants: message_start (with the model the first chat event names) and one ping come
    first, once the chat stream has started (a `resumed` stream, which goes on from where its
    client stands, sends neither); the concatenated deltas of each block are its final thinking,
    text or tool input JSON; the stream ends with message_delta (stop_reason, stop_sequence, usage
    with input and output tokens) and message_stop, or, when the model or the stream failed, with
    one `error` event. The chat stream is closed however this ends (client gone included), which
    releases its worker."""

    def event(kind: str, **fields) -> bytes:
        return named_event(kind, {"type": kind, **fields})

    blocks = _Blocks(event, resumed)
    started, finish, matched, chat_usage, error = resumed is not None, None, None, None, None
    last_id = None
    try:
        async for chat_event in json_events(chat_chunks):
            produced = []
            if not started:
                started = True
                produced += [
                    event("message_start", message=message_skeleton(message_id, chat_event.get("model") or model)),
                    event("ping"),
                ]
            if "error" in chat_event:
                error = chat_event["error"]
                break
            chat_usage = chat_event.get("usage") or chat_usage
            for choice in chat_event.get("choices") or []:
                delta = choice.get("delta") or {}
                reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                produced += blocks.thinking(reasoning) if reasoning else []
                produced += blocks.text(delta["content"]) if delta.get("content") else []
                for call in delta.get("tool_calls") or []:
                    produced += blocks.call(call)
                if choice.get("finish_reason"):
                    finish, matched = choice["finish_reason"], choice.get("stop_reason")
            last_id = chat_event.get("event_id") or last_id
            if produced:
                yield _identified(b"".join(produced), blocks, last_id)
        if error is None and finish is None:
            error = {"message": "the stream ended before the message was finished"}
        reason = None if error is not None else stop_reason(finish, matched)
    except ValueError as exc:
        error = {"message": str(exc)}
    finally:
        await chat_chunks.aclose()
    if error is not None:
        yield named_event("error", error_body(error.get("code"), error.get("message") or "the model failed"))
        return
    closing = b"".join(blocks.close())
    closing += event(
        "message_delta", delta={"stop_reason": reason[0], "stop_sequence": reason[1]}, usage=usage(chat_usage)
    )
    yield _identified(closing + event("message_stop"), blocks, last_id)


def _identified(events: bytes, blocks: _Blocks, chat_event_id: str | None) -> bytes:
    """The events made from one chat event, the last one with the SSE id of where they leave the
    client (none for a stream without a journal)."""
    if chat_event_id is None:
        return events
    head, _, last = events.rstrip(b"\n").rpartition(b"\n\n")
    last_event = b"id: " + str(blocks.position(chat_event_id)).encode() + b"\n" + last + b"\n\n"
    return head + b"\n\n" + last_event if head else last_event
