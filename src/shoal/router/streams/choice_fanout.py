"""Requests for n > 1 choices run as n single-choice streams, each failing over on its own, merged
into one stream.

Choice i runs with seed + i when the request has a seed, which is what a worker does for n choices,
so the merged response is the one a single worker would have given. Merging keeps the first
stream's response id, numbers each choice by its stream, and sums the usage (the prompt counted
once; reasoning tokens summed too).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from shoal.protocol.sse import DONE, data_event, data_values, is_done, json_data


def choice_bodies(body: dict, force_stream: bool) -> list[dict]:
    """One worker request per choice. With force_stream (a non-streaming client) or n > 1, every
    one streams with usage, so the router can follow its tokens and count them."""
    n = body.get("n") or 1
    if n == 1 and not force_stream:
        return [body]
    seed = body.get("seed")
    return [
        {
            **body,
            "n": 1,
            "stream": True,
            "stream_options": {"include_usage": True},
            **({"seed": seed + i} if isinstance(seed, int) else {}),
        }
        for i in range(n)
    ]


async def merged(streams: list[AsyncIterator[bytes]], include_usage: bool) -> AsyncIterator[bytes]:
    """Interleaves the choices' server-sent events as they come. Invariants: each choice's events
    keep their order; exactly one `[DONE]`, last; one usage event before it if include_usage."""
    queue: asyncio.Queue[tuple[int, bytes | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[bytes]) -> None:
        try:
            async for chunk in stream:
                await queue.put((index, chunk))
        finally:
            await queue.put((index, None))

    pumps = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    response_id, usage, running = None, None, len(streams)
    try:
        while running:
            index, chunk = await queue.get()
            if chunk is None:
                running -= 1
                continue
            for data in data_values(chunk):  # keep-alives have none
                if is_done(data):
                    continue  # each stream's [DONE]
                event = json_data(data)
                if "error" in event:
                    yield data_event(data)
                    continue
                if event.get("usage") and not event.get("choices"):
                    usage = _add_usage(usage, event["usage"])
                    continue
                response_id = response_id or event.get("id")
                event["id"] = response_id
                for choice in event.get("choices") or []:
                    choice["index"] = index
                yield data_event(event)
        if include_usage and usage is not None:
            yield data_event({"id": response_id, "choices": [], "usage": usage})
        yield DONE
    finally:
        for task in pumps:
            task.cancel()
        for task in pumps:
            with contextlib.suppress(asyncio.CancelledError):
                await task


def _add_usage(total: dict | None, usage: dict) -> dict:
    if total is None:
        return dict(usage)
    completion = total["completion_tokens"] + usage["completion_tokens"]
    added = {**total, "completion_tokens": completion, "total_tokens": total["prompt_tokens"] + completion}
    reasoning = [(u.get("completion_tokens_details") or {}).get("reasoning_tokens") for u in (total, usage)]
    if any(count is not None for count in reasoning):
        added["completion_tokens_details"] = {"reasoning_tokens": sum(count or 0 for count in reasoning)}
    return added
