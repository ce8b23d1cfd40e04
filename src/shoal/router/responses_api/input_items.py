"""Input items of /v1/responses: validated and normalised (as OpenAI lists them), paged for
`GET /v1/responses/{id}/input_items`, and turned into the chat messages a worker is sent.

Items are messages, the model's function calls (`function_call`, as a response's output lists
them) and their results (`function_call_output`), and its reasoning (`reasoning`, as a response's
output lists it); a tool loop sends the calls back with the results, or continues from a stored
response that holds the calls."""

from __future__ import annotations

from shoal.router.placement.route_request import RequestError
from shoal.router.responses_api.ids import new_function_call_id, new_message_id, new_reasoning_id
from shoal.router.responses_api.message_items import (
    function_call_item,
    output_message,
    output_text_part,
    reasoning_item,
    reasoning_text_part,
)
from shoal.router.responses_api.stored_turn import StoredTurn

ROLES = ("user", "system", "developer", "assistant")
TEXT_PART_TYPES = ("input_text", "output_text")


def normalize_input(raw: object) -> list[dict]:
    """The request's `input` as message items, each with a new id, status "completed" and content
    as a list of text parts (output_text for the assistant, input_text for the others). Raises
    RequestError naming the offending field, as OpenAI does (`input[1].content[0].text`)."""
    if isinstance(raw, str):
        if not raw:
            raise RequestError("`input` must not be empty", "input")
        return [_message("user", [raw])]
    if not isinstance(raw, list) or not raw:
        raise RequestError("`input` must be a non-empty string or a non-empty list of message items", "input")
    return [_normalize_item(item, f"input[{index}]") for index, item in enumerate(raw)]


def _normalize_item(item: object, where: str) -> dict:
    if not isinstance(item, dict):
        raise RequestError(f"`{where}` must be a message object with `role` and `content`", where)
    kind = item.get("type", "message")
    if kind == "function_call":
        return _function_call(item, where)
    if kind == "function_call_output":
        return _function_call_output(item, where)
    if kind == "reasoning":
        return _reasoning(item, where)
    if kind != "message":
        raise RequestError(
            f'`{where}.type` {kind!r} is not supported; items are "message", "function_call", '
            '"function_call_output" or "reasoning"',
            f"{where}.type",
        )
    role = item.get("role")
    if role not in ROLES:
        raise RequestError(f"`{where}.role` must be one of {', '.join(ROLES)}", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        return _message(role, [content])
    if not isinstance(content, list) or not content:
        raise RequestError(f"`{where}.content` must be a string or a non-empty list of text parts", f"{where}.content")
    return _message(role, [_part_text(part, f"{where}.content[{index}]") for index, part in enumerate(content)])


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (not value and key != "output"):
        raise RequestError(
            f"`{where}.{key}` must be a {'' if key == 'output' else 'non-empty '}string", f"{where}.{key}"
        )
    return value


def _function_call(item: dict, where: str) -> dict:
    return function_call_item(
        item.get("id") if isinstance(item.get("id"), str) else new_function_call_id(),
        _string(item, "call_id", where),
        _string(item, "name", where),
        _string(item, "arguments", where),
    )


def _function_call_output(item: dict, where: str) -> dict:
    return {
        "type": "function_call_output",
        "id": item.get("id") if isinstance(item.get("id"), str) else new_function_call_id("fco_"),
        "call_id": _string(item, "call_id", where),
        "output": _string(item, "output", where),
        "status": "completed",
    }


def _reasoning(item: dict, where: str) -> dict:
    """A reasoning item: its text in `content` (reasoning_text parts) or, from a server that gives
    summaries, `summary` (summary_text parts). Encrypted reasoning cannot be read here."""
    if item.get("encrypted_content") is not None:
        raise RequestError(f"`{where}.encrypted_content` is not supported", f"{where}.encrypted_content")
    texts = []
    for key, part_type in (("summary", "summary_text"), ("content", "reasoning_text")):
        parts = item.get(key)
        if parts is None and key == "content":
            continue
        if not isinstance(parts, list):
            raise RequestError(f"`{where}.{key}` must be a list of {part_type} parts", f"{where}.{key}")
        for index, part in enumerate(parts):
            if not isinstance(part, dict) or part.get("type") != part_type or not isinstance(part.get("text"), str):
                raise RequestError(
                    f'`{where}.{key}[{index}]` must be {{"type": "{part_type}", "text": ...}}',
                    f"{where}.{key}[{index}]",
                )
            texts.append((key, part["text"]))
    content = [text for key, text in texts if key == "content"] or [text for _, text in texts]
    item_id = item.get("id") if isinstance(item.get("id"), str) else new_reasoning_id()
    return reasoning_item(item_id, "completed", [reasoning_text_part("\n\n".join(content))] if content else [])


def _part_text(part: object, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") not in TEXT_PART_TYPES:
        raise RequestError(
            f'`{where}` must be a text part: {{"type": "input_text" or "output_text", '
            f'"text": ...}} (other content types are not supported)',
            f"{where}.type",
        )
    if not isinstance(part.get("text"), str):
        raise RequestError(f"`{where}.text` must be a string", f"{where}.text")
    return part["text"]


def _message(role: str, texts: list[str]) -> dict:
    if role == "assistant":
        return output_message(new_message_id(), "completed", [output_text_part(text) for text in texts])
    return {
        "type": "message",
        "id": new_message_id(),
        "status": "completed",
        "role": role,
        "content": [{"type": "input_text", "text": text} for text in texts],
    }


def item_messages(items: list[dict]) -> list[dict]:
    """Chat messages for items (input items or a response's output): a message's text parts are
    joined, as the workers join text parts of chat content; function calls join the assistant
    message before them (or make one), and each call's output is a tool message. A reasoning item's
    text is the `reasoning_content` of the assistant message that follows it (the chat template
    decides whether the model sees it); one that no assistant message follows is left out."""
    messages: list[dict] = []
    reasoning = None
    for item in items:
        if item["type"] == "reasoning":
            reasoning = "".join(part["text"] for part in item["content"]) or None
            continue
        if item["type"] == "function_call":
            call = {
                "id": item["call_id"],
                "type": "function",
                "function": {"name": item["name"], "arguments": item["arguments"]},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif item["type"] == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
        else:
            messages.append({"role": item["role"], "content": "".join(part["text"] for part in item["content"])})
        if messages and messages[-1]["role"] == "assistant" and reasoning is not None:
            messages[-1]["reasoning_content"] = reasoning
        reasoning = None
    return messages


def conversation_messages(instructions: str | None, chain: list[StoredTurn], new_items: list[dict]) -> list[dict]:
    """What the model is sent for a new response: this request's instructions (earlier turns'
    instructions are not carried over, as in OpenAI), then each earlier turn oldest first (its
    input items, then its output), then the new input."""
    messages = [{"role": "system", "content": instructions}] if instructions else []
    for turn in chain:
        messages += item_messages(turn.input_items) + item_messages(turn.response["output"])
    return messages + item_messages(new_items)
