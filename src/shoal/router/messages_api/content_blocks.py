"""A Messages request's `system` and `messages` as the chat messages of a chat completion.

Blocks map one to one onto chat message parts, in order:
- `text` blocks are text (a run of them, one message's text, concatenated as the worker joins a
  chat message's text parts);
- an assistant's `thinking` blocks are its `reasoning_content` (which thinking templates render),
  its `tool_use` blocks its `tool_calls` (the input as JSON arguments, the id kept);
- a user's `tool_result` block is a `tool` message answering `tool_use_id`; its content is a string
  or text blocks, and `is_error: true` is written into it as an "Error: " prefix (the chat schema
  has no error flag, so the model reads it in the text).
`cache_control` marks are accepted wherever Anthropic takes them and change nothing: the workers
cache every prompt prefix (automatic prefix caching), so each breakpoint is already served.
Any other block type, or a block in the wrong role, is a RequestError naming it.
"""

from __future__ import annotations

import json

from shoal.router.placement.route_request import RequestError

# The fields each block type may have, per role that may send it.
BLOCK_FIELDS = {
    "text": {"type", "text", "cache_control", "citations"},
    "tool_use": {"type", "id", "name", "input", "cache_control"},
    "tool_result": {"type", "tool_use_id", "content", "is_error", "cache_control"},
    "thinking": {"type", "thinking", "signature"},
}
ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking")}


def _string(block: dict, name: str, where: str) -> str:
    value = block.get(name)
    if not isinstance(value, str):
        raise RequestError(f"`{where}.{name}` must be a string", f"{where}.{name}")
    return value


def _block(block: object, allowed: tuple[str, ...], where: str) -> dict:
    """A block of one of the `allowed` types, with only its type's fields; citations and
    cache_control only in the forms served."""
    kind = block.get("type") if isinstance(block, dict) else None
    if kind not in allowed:
        raise RequestError(
            f"`{where}.type` {kind!r} is not supported here; use one of {', '.join(allowed)}", f"{where}.type"
        )
    unknown = sorted(set(block) - BLOCK_FIELDS[kind])
    if unknown:
        raise RequestError(f"`{where}.{unknown[0]}` is not supported", f"{where}.{unknown[0]}")
    if block.get("citations"):
        raise RequestError(f"`{where}.citations` is not supported", f"{where}.citations")
    check_cache_control(block.get("cache_control"), f"{where}.cache_control")
    return block


def check_cache_control(value: object, where: str) -> None:
    """A cache_control mark: absent, or {"type": "ephemeral"} with an optional ttl."""
    if value is not None and (
        not isinstance(value, dict) or value.get("type") != "ephemeral" or set(value) - {"type", "ttl"}
    ):
        raise RequestError(f'`{where}` must be {{"type": "ephemeral"}}', where)


def _text(content: object, where: str, allowed: tuple[str, ...] = ("text",)) -> str:
    """The text of a string or of a list of text blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"`{where}` must be a string or a list of content blocks", where)
    return "".join(_string(_block(b, allowed, f"{where}[{i}]"), "text", f"{where}[{i}]") for i, b in enumerate(content))


def system_messages(system: object) -> list[dict]:
    """The system message of `system` (a string or text blocks); none when it is absent."""
    return [] if system is None else [{"role": "system", "content": _text(system, "system")}]


def _tool_result(block: dict, where: str) -> dict:
    content = block.get("content", "")
    text = _text(content, f"{where}.content")
    is_error = block.get("is_error", False)
    if not isinstance(is_error, bool):
        raise RequestError(f"`{where}.is_error` must be a boolean", f"{where}.is_error")
    return {
        "role": "tool",
        "tool_call_id": _string(block, "tool_use_id", where),
        "content": f"Error: {text}" if is_error else text,
    }


def _user_messages(blocks: list, where: str) -> list[dict]:
    """A user turn's messages: each run of text blocks one user message, each tool_result one
    tool message, in block order."""
    messages: list[dict] = []
    for index, raw in enumerate(blocks):
        here = f"{where}[{index}]"
        block = _block(raw, ROLE_BLOCKS["user"], here)
        if block["type"] == "tool_result":
            messages.append(_tool_result(block, here))
        elif messages and messages[-1]["role"] == "user":
            messages[-1]["content"] += _string(block, "text", here)
        else:
            messages.append({"role": "user", "content": _string(block, "text", here)})
    return messages


def _assistant_message(blocks: list, where: str) -> dict:
    text, thinking, calls = [], [], []
    for index, raw in enumerate(blocks):
        here = f"{where}[{index}]"
        block = _block(raw, ROLE_BLOCKS["assistant"], here)
        if block["type"] == "text":
            text.append(_string(block, "text", here))
        elif block["type"] == "thinking":
            thinking.append(_string(block, "thinking", here))
        else:
            if not isinstance(block.get("input"), dict):
                raise RequestError(f"`{here}.input` must be an object", f"{here}.input")
            calls.append(
                {
                    "id": _string(block, "id", here),
                    "type": "function",
                    "function": {"name": _string(block, "name", here), "arguments": json.dumps(block["input"])},
                }
            )
    message = {"role": "assistant", "content": "".join(text)}
    if thinking:
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def chat_messages(messages: object) -> list[dict]:
    """The chat messages of a Messages request's `messages` (a non-empty list of user and
    assistant turns, each with a string or a list of blocks as content)."""
    if not isinstance(messages, list) or not messages:
        raise RequestError("`messages` must be a non-empty list", "messages")
    chat: list[dict] = []
    for index, message in enumerate(messages):
        where = f"messages[{index}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ROLE_BLOCKS:
            raise RequestError(f'`{where}.role` must be "user" or "assistant"', f"{where}.role")
        unknown = sorted(set(message) - {"role", "content"})
        if unknown:
            raise RequestError(f"`{where}.{unknown[0]}` is not supported", f"{where}.{unknown[0]}")
        content = message.get("content")
        if isinstance(content, str):
            chat.append({"role": role, "content": content})
        elif not isinstance(content, list):
            raise RequestError(f"`{where}.content` must be a string or a list of content blocks", f"{where}.content")
        elif role == "user":
            if not content:
                raise RequestError(f"`{where}.content` must not be empty", f"{where}.content")
            chat += _user_messages(content, f"{where}.content")
        else:
            chat.append(_assistant_message(content, f"{where}.content"))
    return chat
