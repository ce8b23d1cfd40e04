"""POST /v1/chat/completions and /v1/completions as a raw ASGI layer in front of the app's routes.

These two carry nearly all of a router's traffic. Served here, a request skips FastAPI's routing,
dependency solving and exception wrappers, which together cost more CPU than the relaying itself
(benchmarks/router_overhead.py). Every other path goes on to the app. Invariant: the two paths are
answered here whatever the method (another method is a 405 naming the one allowed).
"""

from __future__ import annotations

from starlette.requests import Request

from shoal.router.front_door import FrontDoor
from shoal.router.proxy import error_response

CHAT_BY_PATH = {"/v1/chat/completions": True, "/v1/completions": False}


class CompletionEndpoints:
    def __init__(self, app, front_door: FrontDoor):
        self.app = app
        self.front_door = front_door

    async def __call__(self, scope, receive, send):
        chat = CHAT_BY_PATH.get(scope["path"]) if scope["type"] == "http" else None
        if chat is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] == "POST":
            response = await self.front_door.handle(Request(scope, receive), scope["path"], chat)
        else:
            response = error_response(
                405,
                f"{scope['method']} is not allowed on {scope['path']}; use POST",
                "invalid_request_error",
                headers={"allow": "POST"},
            )
        await response(scope, receive, send)
