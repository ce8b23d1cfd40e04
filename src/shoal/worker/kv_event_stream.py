"""A worker's KV events for the routers that follow it, and the prompts it announces to them.

GET /shoal/kv_events?epoch=E&after=N streams frames (shoal.protocol.kv_events): the events
after number N when E is this engine's epoch and it still holds them, else a snapshot first; then
new events as they happen (looked for every POLL_S), and an empty batch at least every IDLE_S so
the router knows the stream lives. Where the worker has the cluster secret the caller must bear it.
It lies outside /v1/: a router's stream is no request, so a draining worker neither refuses it nor
waits for it to end (the server cuts it as it stops).
404 where the engine publishes no events (config kv_events off, or a windowed or hybrid model).

Each prompt the worker serves is announced (`announce_prompt`) before it is computed: which of its
token blocks each of the router's prefix keys for it needs (shoal.worker.prompt_keys).
"""

from __future__ import annotations

import asyncio
import time

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from shoal.engine.async_engine import AsyncLLMEngine
from shoal.errors import ModelNotFoundError
from shoal.model.tokenizer import Tokenizer
from shoal.protocol.kv_events import encode_frame
from shoal.protocol.prefix_keys import CanonicalPrompt, canonical_completion, router_keys
from shoal.worker.cluster_bearer import authorize
from shoal.worker.prompt_keys import prompt_keys

POLL_S = 0.02
IDLE_S = 2.0
MEDIA_TYPE = "application/x-shoal-kv-events"


def add_kv_event_routes(app: FastAPI, engine: AsyncLLMEngine) -> None:
    @app.get("/shoal/kv_events", include_in_schema=False)  # a cluster-internal stream that does not end
    async def kv_events(request: Request, epoch: str = "", after: int = -1):
        authorize(request, "following KV events")
        log = engine.engine.kv_events
        if log is None:
            raise ModelNotFoundError("this worker publishes no KV events")

        async def frames():
            seq = after if epoch == log.epoch else -1
            sent = 0.0
            while True:
                batch = log.read(seq) if seq >= 0 else None
                if batch is None:
                    snapshot = log.snapshot()
                    seq, sent = snapshot.seq, time.monotonic()
                    yield encode_frame(snapshot)
                elif batch.events or time.monotonic() - sent >= IDLE_S:
                    seq, sent = seq + len(batch.events), time.monotonic()
                    yield encode_frame(batch)
                await asyncio.sleep(POLL_S)

        return StreamingResponse(frames(), media_type=MEDIA_TYPE)


def announce_prompt(
    engine: AsyncLLMEngine,
    canonical: CanonicalPrompt,
    rendered: str,
    token_ends: list[int],
    prompt_ids: list[int],
    cache_key: str | None,
    lora: str | None,
) -> None:
    """Publishes which of the prompt's token blocks each of its prefix keys needs (nothing where the
    engine publishes no events, or no key needs a block)."""
    inner = engine.engine
    if inner.kv_events is None:
        return
    manager = inner.block_manager
    keys = router_keys(canonical.text, cache_key, lora)
    keys, blocks = prompt_keys(keys, canonical, rendered, token_ends, manager.block_size, cache_key)
    if keys:
        salt = inner.loras.salt(lora) if lora is not None else None
        inner.kv_events.mapped(manager.chain(prompt_ids, max(blocks), salt), keys, blocks)


def completion_prompt(tokenizer: Tokenizer, prompt: str | list[int]) -> tuple[list[int], CanonicalPrompt, list[int]]:
    """A completion's prompt ids, its canonical prompt (whose text the ids stand for: token ids
    written out with spaces between), and where each id ends in that text."""
    canonical = canonical_completion(prompt)
    if isinstance(prompt, str):
        ids, ends = tokenizer.encode_with_ends(prompt)
        return ids, canonical, ends
    ids = list(prompt)
    ends, offset = [], -1
    for token in ids:
        offset += 1 + len(str(token))
        ends.append(offset)
    return ids, canonical, ends
