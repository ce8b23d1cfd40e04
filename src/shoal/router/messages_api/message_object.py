"""The Messages API's message object, from a chat completion's parts: its id, content blocks,
stop reason and usage."""

from __future__ import annotations

import json
import uuid

# A chat finish_reason as Anthropic's stop_reason ("stop" is end_turn, or stop_sequence when a
# stop sequence ended it).
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def stop_reason(finish_reason: str, matched: object) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a finished choice; `matched` is its chat stop_reason (the
    stop string, or token id, that ended it). ValueError for a finish reason Anthropic has no word
    for."""
    if finish_reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    if finish_reason not in STOP_REASONS:
        raise ValueError(f"the model finished with {finish_reason!r}")
    return STOP_REASONS[finish_reason], None


def tool_input(arguments: str) -> dict | str:
    """A tool call's input: its JSON arguments as an object; arguments cut short by max_tokens
    (not JSON yet) stay the text they are."""
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def thinking_block(thinking: str) -> dict:
    return {"type": "thinking", "thinking": thinking, "signature": ""}


def tool_use_block(call_id: str, name: str, arguments: str | None) -> dict:
    """A tool_use block; arguments None for the opening block of a stream (input arrives as deltas)."""
    return {
        "type": "tool_use",
        "id": call_id,
        "name": name,
        "input": {} if arguments is None else tool_input(arguments),
    }


def usage(chat_usage: dict | None) -> dict:
    chat_usage = chat_usage or {}
    return {"input_tokens": chat_usage.get("prompt_tokens", 0), "output_tokens": chat_usage.get("completion_tokens", 0)}


def message_skeleton(message_id: str, model: str) -> dict:
    """The message as a stream's message_start gives it: no content, no stop reason yet, and usage
    still zero (the chat stream reports it at its end; message_delta carries it)."""
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage(None),
    }


def message_object(message_id: str, completion: dict) -> dict:
    """The message of a non-streamed chat completion: a thinking block for its reasoning, a text
    block for its text, one tool_use block per call, in that order (content is empty when the
    model said nothing)."""
    choice = completion["choices"][0]
    chat = choice["message"]
    content = [thinking_block(chat["reasoning_content"])] if chat.get("reasoning_content") else []
    if chat.get("content"):
        content.append({"type": "text", "text": chat["content"]})
    for call in chat.get("tool_calls") or []:
        content.append(tool_use_block(call["id"], call["function"]["name"], call["function"]["arguments"]))
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"))
    return {
        **message_skeleton(message_id, completion["model"]),
        "content": content,
        "stop_reason": reason,
        "stop_sequence": sequence,
        "usage": usage(completion.get("usage")),
    }
