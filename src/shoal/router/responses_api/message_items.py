"""The parts of an assistant message as the Responses API shows them: in a response's output, and
among the input items of a conversation (which also parse them from clients)."""

from __future__ import annotations


def output_text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": []}


def output_message(message_id: str, status: str, content: list[dict]) -> dict:
    return {"type": "message", "id": message_id, "status": status, "role": "assistant", "content": content}
