"""A worker stand-in that answers as a script says (errors, early deaths), for the router's failure handling."""

from __future__ import annotations

import asyncio
import json
import threading

from aiohttp import web

from tests.support.workers import MODEL, free_port

TRUNCATED_PIECES = ["ab", "c"]


class ScriptedWorker:
    """Serves /v1/models; answers completions with `mode`: "500", "400", "ok" (a one-token SSE
    stream), "cut" (the stream's headers, then the connection closes before any event) or
    "truncated" (TRUNCATED_TEXT in chunks without token ids, then `[DONE]` with no finish reason, as
    llama-cpp-python ends a stream another request interrupts)."""

    def __init__(self):
        self.mode = "500"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.completions = 0
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        threading.Thread(target=self._serve, args=(ready,), daemon=True).start()
        ready.wait(10)

    def _serve(self, ready: threading.Event) -> None:
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._complete)
        runner = web.AppRunner(app)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", self.port).start())
        ready.set()
        self.loop.run_forever()

    async def _models(self, _: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        self.completions += 1
        if self.mode == "cut":
            response = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await response.prepare(request)
            request.transport.close()
            return response
        if self.mode == "truncated":
            return await self._truncated(request)
        if self.mode != "ok":
            status = int(self.mode)
            return web.json_response(
                {"error": {"message": f"scripted {status}", "type": "x", "code": status}}, status=status
            )
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        chunk = {
            "id": "chatcmpl-scripted",
            "object": "chat.completion.chunk",
            "model": MODEL,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": "x"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
        }
        await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\ndata: [DONE]\n\n")
        return response

    async def _truncated(self, request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        deltas = [{"role": "assistant"}] + [{"content": piece} for piece in TRUNCATED_PIECES]
        for delta in deltas:
            chunk = {"id": "chatcmpl-cut-short", "object": "chat.completion.chunk", "model": MODEL}
            chunk["choices"] = [{"index": 0, "delta": delta, "finish_reason": None}]
            await response.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await response.write(b"data: [DONE]\n\n")
        return response
