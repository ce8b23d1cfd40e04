"""An upstream for router_overhead.py that streams its answer one event at a time, `--pace-ms`
apart, as an engine writes each token when it is generated (nginx's fixed answer goes out in one
write). It answers every POST to /v1/chat/completions with the body given in --body-file.

    python benchmarks/paced_upstream.py --port 8001 --body-file answer.sse --pace-ms 2
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from aiohttp import web


def app(events: list[bytes], pace_s: float) -> web.Application:
    async def stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        response = web.StreamResponse(headers={"content-type": "text/event-stream"})
        await response.prepare(request)
        for event in events:
            await response.write(event)
            await asyncio.sleep(pace_s)
        await response.write_eof()
        return response

    async def models(_: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "bench", "object": "model"}]})

    async def health(_: web.Request) -> web.Response:
        return web.Response()

    application = web.Application()
    application.add_routes(
        [web.post("/v1/chat/completions", stream), web.get("/v1/models", models), web.get("/health", health)]
    )
    return application


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--body-file", type=Path, required=True)
    parser.add_argument("--pace-ms", type=float, default=2.0)
    args = parser.parse_args()
    events = [event + b"\n\n" for event in args.body_file.read_bytes().split(b"\n\n") if event]
    web.run_app(app(events, args.pace_ms / 1000), host="127.0.0.1", port=args.port, print=None, access_log=None)


if __name__ == "__main__":
    main()
