"""The items of the model's output as the Responses API shows them (reasoning, assistant messages
and their parts, function calls): in a response's output, and among the input items of a
conversation (which also parse them from clients)."""

from __future__ import annotations


def output_text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    """`logprobs` (include "message.output_text.logprobs"): the output tokens' entries, as the chat
    completion's logprobs.content gives them (token, logprob, bytes, top_logprobs)."""
    part = {"type": "output_text", "text": text, "annotations": []}
    return part if logprobs is None else {**part, "logprobs": logprobs}


def output_message(message_id: str, status: str, content: list[dict]) -> dict:
    return {"type": "message", "id": message_id, "status": status, "role": "assistant", "content": content}


def reasoning_text_part(text: str) -> dict:
    return {"type": "reasoning_text", "text": text}


def reasoning_item(item_id: str, status: str, content: list[dict]) -> dict:
    """The model's reasoning: its text as `content` parts (shoal writes no summaries)."""
    return {"type": "reasoning", "id": item_id, "summary": [], "content": content, "status": status}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }
