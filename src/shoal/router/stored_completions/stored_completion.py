"""A chat completion stored with `store: true`, as the router's state store keeps it."""

from __future__ import annotations

import time

from shoal.router.state.records import Record

KIND = "chat.completion"


def completion_record(completion: dict, request: dict, owner: str) -> Record:
    """Invariant: the record holds the completion as its client received it, with the request's
    metadata (or null) added, and the request's messages, each with its id (COMPLETION_ID-INDEX);
    lists run in the order completions were stored (to the microsecond, not the second of `created`)."""
    messages = [{"id": f"{completion['id']}-{index}", **message} for index, message in enumerate(request["messages"])]
    stored = {**completion, "metadata": request.get("metadata")}
    return Record(KIND, completion["id"], owner, time.time(), {"completion": stored, "messages": messages})


def listed_message(message: dict) -> dict:
    """A stored request message as OpenAI lists it: text content as a string, and its parts too
    when it came in parts."""
    content = message.get("content")
    parts = content if isinstance(content, list) else None
    text = "".join(p.get("text") or "" for p in parts if isinstance(p, dict)) if parts is not None else content
    shown = {key: value for key, value in message.items() if key not in ("content", "name")}
    return {**shown, "content": text, "name": message.get("name"), "content_parts": parts}


def metadata_filter(query_items: list[tuple[str, str]]) -> dict[str, str]:
    """The `metadata[KEY]=VALUE` pairs of a list query."""
    return {
        key[len("metadata[") : -1]: value
        for key, value in query_items
        if key.startswith("metadata[") and key.endswith("]")
    }
