"""Server-sent events as shoal writes and reads them: the worker's and the router's completion
streams, the Responses API's named events, and their readers (the router's relay, `shoal chat`,
`shoal bench`).

Every event is one `data:` line (and, for the Responses API, an `event:` line before it) ended by
a blank line; a stream ends with `data: [DONE]`. Lines starting with ":" are comments, which
clients skip (the worker's keep-alives are comments: protocol.keep_alive). Readers take one line
at a time, so they do not care how the bytes were split.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec

DONE = b"data: [DONE]\n\n"
_DONE_DATA = b"[DONE]"


def data_event(payload: dict[str, Any] | bytes) -> bytes:
    """One `data:` event of a JSON object (or of JSON already encoded)."""
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return b"data: " + body + b"\n\n"


def named_event(kind: str, payload: dict[str, Any]) -> bytes:
    """One event with its `event:` name, as the Responses API streams them."""
    return b"event: " + kind.encode() + b"\ndata: " + json.dumps(payload).encode() + b"\n\n"


def data_of(line: bytes | str) -> bytes | None:
    """The value of one line's `data` field (one leading space dropped, as the SSE spec says), or
    None when the line is a comment, another field or blank."""
    raw = line.encode() if isinstance(line, str) else line
    raw = raw.rstrip(b"\r\n")
    if not raw.startswith(b"data:"):
        return None
    value = raw[5:]
    return value[1:] if value.startswith(b" ") else value


def data_values(chunk: bytes) -> list[bytes]:
    """The `data` values of the whole events in a chunk, in order (a relayed chunk holds one or
    more whole events: those that arrived together)."""
    return [value for line in chunk.split(b"\n") if (value := data_of(line)) is not None]


def is_done(data: bytes) -> bool:
    """Whether a `data` value is the end of the stream."""
    return data.strip() == _DONE_DATA


def json_data(data: bytes) -> dict[str, Any]:
    """A `data` value as the JSON object it must be; ValueError otherwise. Read by msgspec (a relayed
    stream reads one per token), by the json module where msgspec refuses (NaN and Infinity, which
    Python's servers may write)."""
    try:
        event = msgspec.json.decode(data)
    except msgspec.DecodeError:
        event = json.loads(data)
    if not isinstance(event, dict):
        raise ValueError("an event's data is not a JSON object")
    return event


async def json_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON objects of a stream's `data:` events, in order, up to `[DONE]`, however the bytes
    are split into chunks."""
    buffer = b""
    async for chunk in chunks:
        *lines, buffer = (buffer + chunk).split(b"\n")
        for line in lines:
            data = data_of(line)
            if data is None:
                continue
            if is_done(data):
                return
            yield json_data(data)
