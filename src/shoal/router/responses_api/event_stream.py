"""Turns the chat completion stream of a response into the Responses API's server-sent events."""

from __future__ import annotations

import itertools
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from shoal.protocol.sse import json_events, named_event
from shoal.router.responses_api.ids import ItemIds
from shoal.router.responses_api.message_items import (
    function_call_item,
    output_message,
    output_text_part,
    reasoning_item,
    reasoning_text_part,
)
from shoal.router.responses_api.response_object import failed_response, finished_response, output_status
from shoal.router.state.records import StoreUnavailable


class _OutputItems:
    """The response's output items as the chat stream brings them: a reasoning item, opened at the
    first reasoning text; the assistant message, opened at its first text; and one function_call
    item per tool call, opened at the call's first delta (which names it). Output indexes follow
    the order in which items opened. With `logprobs`, the output tokens' logprobs go with the next
    text delta (those after the last text with output_text.done), so they add up to the message's."""

    def __init__(self, message_id: str, event: Callable[..., bytes], logprobs: bool, ids: ItemIds):
        self.message_id = message_id
        self.ids = ids
        self.event = event
        self.logprobs: list[dict] | None = [] if logprobs else None  # all the output's so far
        self.unsent = 0  # of which not yet sent with a delta
        self.order: list[dict] = []  # {"kind": "reasoning" | "message" | "call", "output_index", ...}
        self.thought: dict | None = None
        self.message: dict | None = None
        self.calls: dict[int, dict] = {}

    def reasoning(self, delta: str) -> list[bytes]:
        events = [] if self.thought is not None else self._open_reasoning()
        self.thought["text"].append(delta)
        return [*events, self.event("response.reasoning_text.delta", **_position(self.thought), delta=delta)]

    def token_logprobs(self, entries: list[dict]) -> None:
        if self.logprobs is not None:
            self.logprobs.extend(entries)
            self.unsent += len(entries)

    def text(self, delta: str) -> list[bytes]:
        events = [] if self.message is not None else self._open_message()
        self.message["text"].append(delta)
        position, sent = _position(self.message), self._take_unsent()
        return [*events, self.event("response.output_text.delta", **position, delta=delta, logprobs=sent)]

    def _take_unsent(self) -> list[dict]:
        if not self.unsent:
            return []
        sent, self.unsent = self.logprobs[-self.unsent :], 0
        return sent

    def call(self, delta: dict) -> list[bytes]:
        events = []
        item = self.calls.get(delta.get("index", 0))
        if item is None:
            function = delta.get("function") or {}
            item = {
                "kind": "call",
                "output_index": len(self.order),
                "item_id": self.ids.function_call(),
                "call_id": self.ids.call(delta.get("id")),
                "name": function.get("name") or "",
                "arguments": [],
            }
            self.calls[delta.get("index", 0)] = item
            self.order.append(item)
            added = function_call_item(item["item_id"], item["call_id"], item["name"], "", "in_progress")
            events.append(self.event("response.output_item.added", output_index=item["output_index"], item=added))
        fragment = (delta.get("function") or {}).get("arguments")
        if fragment:
            item["arguments"].append(fragment)
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=item["item_id"],
                    output_index=item["output_index"],
                    delta=fragment,
                )
            )
        return events

    def close(self, status: str) -> tuple[list[dict], list[bytes]]:
        """The finished output items, and the events that close them (a response with no items
        gets an empty message)."""
        events = self._open_message() if not self.order else []
        output = []
        for item in self.order:
            if item["kind"] == "reasoning":
                text = "".join(item["text"])
                part = reasoning_text_part(text)
                done = reasoning_item(item["item_id"], status, [part])
                events += [
                    self.event("response.reasoning_text.done", **_position(item), text=text),
                    self.event("response.content_part.done", **_position(item), part=part),
                ]
            elif item["kind"] == "message":
                text = "".join(item["text"])
                part = output_text_part(text, self.logprobs)
                done = output_message(self.message_id, status, [part])
                events += [
                    self.event("response.output_text.done", **_position(item), text=text, logprobs=self._take_unsent()),
                    self.event("response.content_part.done", **_position(item), part=part),
                ]
            else:
                arguments = "".join(item["arguments"])
                done = function_call_item(item["item_id"], item["call_id"], item["name"], arguments)
                events.append(
                    self.event(
                        "response.function_call_arguments.done",
                        item_id=item["item_id"],
                        output_index=item["output_index"],
                        arguments=arguments,
                    )
                )
            events.append(self.event("response.output_item.done", output_index=item["output_index"], item=done))
            output.append(done)
        return output, events

    def _open_reasoning(self) -> list[bytes]:
        self.thought = {
            "kind": "reasoning",
            "output_index": len(self.order),
            "item_id": self.ids.reasoning(),
            "text": [],
        }
        self.order.append(self.thought)
        opened = reasoning_item(self.thought["item_id"], "in_progress", [])
        return [
            self.event("response.output_item.added", output_index=self.thought["output_index"], item=opened),
            self.event("response.content_part.added", **_position(self.thought), part=reasoning_text_part("")),
        ]

    def _open_message(self) -> list[bytes]:
        self.message = {"kind": "message", "output_index": len(self.order), "item_id": self.message_id, "text": []}
        self.order.append(self.message)
        opened = output_message(self.message_id, "in_progress", [])
        return [
            self.event("response.output_item.added", output_index=self.message["output_index"], item=opened),
            self.event("response.content_part.added", **_position(self.message), part=output_text_part("")),
        ]


def _position(item: dict) -> dict:
    """Where a text delta of a reasoning or message item goes (its one content part)."""
    return {"item_id": item["item_id"], "output_index": item["output_index"], "content_index": 0}


async def response_events(
    chat_chunks: AsyncGenerator[bytes, None],
    skeleton: dict,
    message_id: str,
    keep: Callable[[dict], Awaitable[None]],
    logprobs: bool = False,
    ids: ItemIds | None = None,
) -> AsyncIterator[bytes]:
    """Invariants: sequence numbers count from 0 without gaps; the concatenated output_text.delta
    texts are the final text, the reasoning_text.delta texts the final reasoning, and each call's
    function_call_arguments.delta fragments its final arguments; the last event is exactly one of
    response.completed, response.incomplete (cut by max_output_tokens) or response.failed (after
    an `error` event), and `keep(response)` (storing it) has returned before completed or
    incomplete is sent, while a failed response is never kept. The chat stream is closed however
    this ends (client gone included), which releases its worker."""
    sequence = itertools.count()

    def event(kind: str, **fields) -> bytes:
        return named_event(kind, {"type": kind, "sequence_number": next(sequence), **fields})

    def failure(message: str) -> list[bytes]:
        return [
            event("error", code="server_error", message=message, param=None),
            event("response.failed", response=failed_response(skeleton, message)),
        ]

    # Sent once the chat stream has started: closing a chat stream that never started would not
    # run its clean-up, and its worker would stay taken.
    opening = [event("response.created", response=skeleton), event("response.in_progress", response=skeleton)]
    items = _OutputItems(message_id, event, logprobs, ids or ItemIds())
    finish_reason, usage, model, error = None, None, None, None
    try:
        async for chat_event in json_events(chat_chunks):
            for opened in opening:
                yield opened
            opening = []
            if "error" in chat_event:
                error = chat_event["error"].get("message") or "the model failed the request"
                break
            usage = chat_event.get("usage") or usage
            model = chat_event.get("model") or model
            for choice in chat_event.get("choices") or []:
                items.token_logprobs((choice.get("logprobs") or {}).get("content") or [])
                delta = choice.get("delta") or {}
                reasoning = delta.get("reasoning_content") or delta.get("reasoning")
                for produced in items.reasoning(reasoning) if reasoning else []:
                    yield produced
                for produced in items.text(delta["content"]) if delta.get("content") else []:
                    yield produced
                for call in delta.get("tool_calls") or []:
                    for produced in items.call(call):
                        yield produced
                finish_reason = choice.get("finish_reason") or finish_reason
    finally:
        await chat_chunks.aclose()
    if error is not None or finish_reason is None:
        for failed in opening + failure(error or "the stream ended before the response was finished"):
            yield failed
        return
    output, closing = items.close(output_status(finish_reason))
    for closed in closing:
        yield closed
    response = finished_response(skeleton, output, finish_reason, usage, model)
    try:
        await keep(response)
    except StoreUnavailable as exc:
        for failed in failure(f"the response was generated but could not be stored: {exc}"):
            yield failed
        return
    yield event(f"response.{response['status']}", response=response)
