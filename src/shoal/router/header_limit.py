"""Refuses requests whose headers together exceed a size (431, OpenAI-shaped), before any
handler runs."""

from __future__ import annotations

from shoal.errors import error_json


class HeaderLimitMiddleware:
    def __init__(self, app, max_header_bytes: int):
        self.app = app
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and sum(len(k) + len(v) for k, v in scope["headers"]) > self.max_header_bytes:
            body = error_json(f"request headers exceed {self.max_header_bytes} bytes", 431, "invalid_request_error")
            await send(
                {
                    "type": "http.response.start",
                    "status": 431,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())],
                }
            )
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)
