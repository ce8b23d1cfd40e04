"""POST /v1/chat/completions, /v1/completions and /v1/embeddings, served ahead of FastAPI.

These two carry nearly all of a router's traffic. Served here, a request skips FastAPI's
middleware stack, routing, dependency solving and exception wrappers, which together cost more CPU
than the relaying itself (benchmarks/router_overhead.py); RouterApp sends them here and everything
else to FastAPI. What those layers did for these paths is done here: the header size limit (431),
and an OpenAI-shaped 500 for an error before the response starts. Invariant: the paths are answered
here whatever the method (another method is a 405 naming the one allowed), except a GET of
/v1/chat/completions, the list of stored ones, which FastAPI serves.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI
from starlette.requests import Request

from shoal.router.front_door import Around, FrontDoor
from shoal.router.header_limit import oversized_headers
from shoal.router.streams.proxy import error_response

log = logging.getLogger(__name__)
# The paths answered here, and whether each is a chat completion.
CHAT_BY_PATH = {"/v1/chat/completions": True, "/v1/completions": False, "/v1/embeddings": False}
LISTED_BY_GET = {"/v1/chat/completions"}


class CompletionEndpoints:
    def __init__(self, front_door: FrontDoor, max_header_bytes: int, arounds: dict[str, Around] | None = None):
        """`arounds`: what serves a path's parsed requests in place of a plain dispatch (FrontDoor.handle)."""
        self.front_door = front_door
        self.max_header_bytes = max_header_bytes
        self.arounds = arounds or {}

    async def __call__(self, scope, receive, send):
        path, method = scope["path"], scope["method"]
        refusal = oversized_headers(scope, self.max_header_bytes)
        if refusal is not None:
            response = refusal
        elif method != "POST":
            response = error_response(
                405, f"{method} is not allowed on {path}; use POST", "invalid_request_error", headers={"allow": "POST"}
            )
        else:
            try:
                response = await self.front_door.handle(
                    Request(scope, receive), path, CHAT_BY_PATH[path], self.arounds.get(path)
                )
            except Exception:
                log.exception("the router failed a request to %s", path)
                response = error_response(500, "the router failed this request", "internal_error")
        await response(scope, receive, send)


class RouterApp(FastAPI):
    """The router's FastAPI app; the completion endpoints are answered by `completions` before
    FastAPI sees the request."""

    completions: CompletionEndpoints | None = None

    async def __call__(self, scope, receive, send):
        if (
            self.completions is not None
            and scope["type"] == "http"
            and scope["path"] in CHAT_BY_PATH
            and not (scope["method"] == "GET" and scope["path"] in LISTED_BY_GET)
        ):
            await self.completions(scope, receive, send)
            return
        await super().__call__(scope, receive, send)
