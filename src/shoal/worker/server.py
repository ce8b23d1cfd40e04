"""One replica behind OpenAI-compatible HTTP: /v1/completions, /v1/chat/completions, /v1/models,
/health. Streams are server-sent events; every choice also carries its token ids and seed, so a
router can resume the request elsewhere (prompt + token ids, same seed)."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from shoal.engine.async_engine import AsyncLLMEngine
from shoal.engine.outputs import RequestOutput
from shoal.errors import InvalidRequestError
from shoal.worker.drain import DrainState, InFlightMiddleware
from shoal.worker.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields


def error_response(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}}, status_code=status)


class ModelNotFound(Exception):
    pass


def create_app(engine: AsyncLLMEngine, model_name: str, drain: DrainState | None = None) -> FastAPI:
    """The worker's ASGI app. Invariant: a client's mistake is a 4xx for that request only."""
    app = FastAPI(title="shoal worker")
    drain = drain or DrainState()
    app.add_middleware(InFlightMiddleware, state=drain)
    tokenizer = engine.engine.tokenizer
    max_model_len = engine.engine.max_model_len

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        return error_response(400, f"invalid request: {first.get('msg', 'malformed body')}", param=param)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, exc: InvalidRequestError) -> JSONResponse:
        return error_response(400, exc.message, param=exc.param)

    @app.exception_handler(ModelNotFound)
    async def unknown_model(_: Request, exc: ModelNotFound) -> JSONResponse:
        return error_response(404, str(exc), kind="not_found_error", param="model")

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return JSONResponse({"ready": not drain.draining}, status_code=503 if drain.draining else 200)

    @app.get("/load")
    async def load() -> dict:
        """Compact load report for routers (read without locking: each figure is one atomic read)."""
        stats = engine.engine.stats()
        block_manager = engine.engine.block_manager
        return {"model": model_name, "max_model_len": max_model_len, "running": stats.num_running,
                "waiting": stats.num_waiting, "free_kv_blocks": block_manager.num_free_blocks,
                "num_kv_blocks": stats.num_kv_blocks, "block_size": block_manager.block_size,
                "kv_cache_usage": stats.kv_cache_usage}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "shoal",
                                            "max_model_len": max_model_len}]}

    def check_model(body: SamplingFields) -> None:
        if body.model != model_name:
            raise ModelNotFound(f"model {body.model!r} is not served here; this worker serves {model_name!r}")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        check_model(body)
        prompt_ids = tokenizer.encode(body.prompt) if isinstance(body.prompt, str) else list(body.prompt)
        return await _respond(engine, body, prompt_ids, body.max_tokens, body.logprobs, chat=False,
                              model_name=model_name, max_model_len=max_model_len)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        check_model(body)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        prompt_ids = tokenizer.encode(text, add_special_tokens=False)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        return await _respond(engine, body, prompt_ids, body.max_completion_tokens or body.max_tokens, logprobs,
                              chat=True, model_name=model_name, max_model_len=max_model_len)

    return app


async def _respond(engine: AsyncLLMEngine, body: SamplingFields, prompt_ids: list[int], max_tokens: int | None,
                   logprobs: int | None, chat: bool, model_name: str, max_model_len: int):
    request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    room = max_model_len - len(prompt_ids)
    if max_tokens is not None and max_tokens > room:
        raise InvalidRequestError(f"max_tokens={max_tokens} does not fit: the prompt has {len(prompt_ids)} tokens "
                                  f"and the context window {max_model_len}", param="max_tokens")
    max_tokens = max_tokens or max(1, room)
    streams = [engine.generate(prompt_ids, body.sampling_params(
        max_tokens, logprobs, None if body.seed is None else body.seed + i), request_id=f"{request_id}-{i}")
        for i in range(body.n)]
    # Start every choice before answering, so that bad input is a 400 and not a broken stream.
    firsts = [await _first(s) for s in streams]
    meta = {"id": request_id, "created": int(time.time()), "model": model_name}
    render = LogprobRenderer(engine.engine.tokenizer, logprobs, chat)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_sse(streams, firsts, meta, chat, len(prompt_ids), include_usage, render),
                                 media_type="text/event-stream")
    finals = await asyncio.gather(*(_last(s, f) for s, f in zip(streams, firsts)))
    return _full_response(finals, meta, chat, len(prompt_ids), render)


async def _first(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await stream.__anext__()


async def _last(stream: AsyncIterator[RequestOutput], first: RequestOutput) -> RequestOutput:
    last = first
    async for output in stream:
        last = output
    return last


def _usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _full_response(finals: list[RequestOutput], meta: dict, chat: bool, prompt_tokens: int,
                   render: LogprobRenderer) -> dict:
    choices = []
    for index, final in enumerate(finals):
        out = final.outputs[0]
        choice = {"index": index, "finish_reason": out.finish_reason, "token_ids": out.token_ids,
                  "seed": final.seed}
        choice["logprobs"] = render(out.token_ids, out.logprobs)
        if chat:
            choice["message"] = {"role": "assistant", "content": out.text}
        else:
            choice["text"] = out.text
        choices.append(choice)
    completion_tokens = sum(len(f.outputs[0].token_ids) for f in finals)
    return {**meta, "object": "chat.completion" if chat else "text_completion", "choices": choices,
            "usage": _usage(prompt_tokens, completion_tokens)}


async def _sse(streams, firsts, meta: dict, chat: bool, prompt_tokens: int, include_usage: bool,
               render: LogprobRenderer):
    """Merges the choices' outputs into SSE chunks; abandoning it (client gone) aborts every choice."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream, first: RequestOutput) -> None:
        await queue.put((index, first))
        async for output in stream:
            await queue.put((index, output))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
    kind = "chat.completion.chunk" if chat else "text_completion"
    completion_tokens = 0
    try:
        if chat:
            for index in range(len(streams)):
                yield _event({**meta, "object": kind, "choices": [
                    {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        remaining = len(streams)
        while remaining:
            index, output = await queue.get()
            if output is None:
                remaining -= 1
                continue
            completion_tokens += len(output.new_token_ids)
            choice = {"index": index, "finish_reason": output.outputs[0].finish_reason if output.finished
                      else None, "token_ids": output.new_token_ids, "seed": output.seed}
            new = len(output.new_token_ids)
            entries = output.outputs[0].logprobs
            choice["logprobs"] = render(output.new_token_ids, entries[len(entries) - new:] if entries else None)
            if chat:
                choice["delta"] = {"content": output.new_text} if output.new_text else {}
            else:
                choice["text"] = output.new_text
            yield _event({**meta, "object": kind, "choices": [choice]})
        if include_usage:
            yield _event({**meta, "object": kind, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
        yield "data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        for stream in streams:
            await stream.aclose()


class LogprobRenderer:
    """Engine logprobs ({sampled id: lp, top ids...} per token) in OpenAI's completion or chat shape."""

    def __init__(self, tokenizer, top: int | None, chat: bool):
        self.tokenizer = tokenizer
        self.top = top
        self.chat = chat

    def _piece(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def __call__(self, token_ids: list[int], entries: list[dict[int, float]] | None) -> dict | None:
        if self.top is None or entries is None:
            return None
        pieces = [self._piece(t) for t in token_ids]
        tops = [sorted(e.items(), key=lambda kv: -kv[1])[:self.top] for e in entries]
        sampled = [e.get(t) for t, e in zip(token_ids, entries)]
        if self.chat:
            return {"content": [
                {"token": piece, "logprob": lp, "bytes": list(piece.encode()),
                 "top_logprobs": [{"token": self._piece(i), "logprob": v, "bytes": list(self._piece(i).encode())}
                                  for i, v in top]}
                for piece, lp, top in zip(pieces, sampled, tops)]}
        return {"tokens": pieces, "token_logprobs": sampled,
                "top_logprobs": [{self._piece(i): v for i, v in top} for top in tops], "text_offset": []}


def _event(payload: dict) -> str:
    return f"data: {json.dumps(payload)}\n\n"
