"""An HTTP request's body as ASGI delivers it, read up to a limit: the rest of a body known to be
too long is never buffered. Shared by the worker's and the router's front doors."""

from __future__ import annotations

from collections.abc import Awaitable, Callable


async def body_within(receive: Callable[[], Awaitable[dict]], limit: int) -> bytes | None:
    """The whole body, or None as soon as it exceeds `limit` bytes. A client that leaves first
    leaves what it sent (nobody reads the answer)."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":
            return b"".join(chunks)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)
