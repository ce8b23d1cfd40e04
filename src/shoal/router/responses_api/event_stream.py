"""Turns the chat completion stream of a response into the Responses API's server-sent events."""

from __future__ import annotations

import itertools
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable

from shoal.protocol.sse import json_events, named_event
from shoal.router.responses_api.message_items import output_message, output_text_part
from shoal.router.responses_api.response_object import failed_response, finished_response
from shoal.router.responses_api.store import StoreUnavailable


async def response_events(
    chat_chunks: AsyncGenerator[bytes, None], skeleton: dict, message_id: str, keep: Callable[[dict], Awaitable[None]]
) -> AsyncIterator[bytes]:
    """Invariants: sequence numbers count from 0 without gaps; the concatenated output_text.delta
    texts are the final text; the last event is exactly one of response.completed,
    response.incomplete (cut by max_output_tokens) or response.failed (after an `error` event), and
    `keep(response)` (storing it) has returned before completed or incomplete is sent, while a
    failed response is never kept. The chat stream is closed however this ends (client gone
    included), which releases its worker."""
    sequence = itertools.count()

    def event(kind: str, **fields) -> bytes:
        return named_event(kind, {"type": kind, "sequence_number": next(sequence), **fields})

    def failure(message: str) -> list[bytes]:
        return [
            event("error", code="server_error", message=message, param=None),
            event("response.failed", response=failed_response(skeleton, message)),
        ]

    position = {"item_id": message_id, "output_index": 0, "content_index": 0}
    # Sent once the chat stream has started: closing a chat stream that never started would not
    # run its clean-up, and its worker would stay taken.
    opening = [
        event("response.created", response=skeleton),
        event("response.in_progress", response=skeleton),
        event("response.output_item.added", output_index=0, item=output_message(message_id, "in_progress", [])),
        event("response.content_part.added", **position, part=output_text_part("")),
    ]
    pieces, finish_reason, usage, model, error = [], None, None, None, None
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
                delta = (choice.get("delta") or {}).get("content")
                if delta:
                    pieces.append(delta)
                    yield event("response.output_text.delta", **position, delta=delta, logprobs=[])
                finish_reason = choice.get("finish_reason") or finish_reason
    finally:
        await chat_chunks.aclose()
    if error is not None or finish_reason is None:
        for failed in opening + failure(error or "the stream ended before the response was finished"):
            yield failed
        return
    response = finished_response(skeleton, message_id, "".join(pieces), finish_reason, usage, model)
    item = response["output"][0]
    yield event("response.output_text.done", **position, text=item["content"][0]["text"], logprobs=[])
    yield event("response.content_part.done", **position, part=item["content"][0])
    yield event("response.output_item.done", output_index=0, item=item)
    try:
        await keep(response)
    except StoreUnavailable as exc:
        for failed in failure(f"the response was generated but could not be stored: {exc}"):
            yield failed
        return
    yield event(f"response.{response['status']}", response=response)
