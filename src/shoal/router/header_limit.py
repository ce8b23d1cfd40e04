"""Refuses requests whose headers together exceed a size (431, OpenAI-shaped), before any
handler runs."""

from __future__ import annotations

from starlette.responses import Response

from shoal.router.streams.proxy import error_response


def oversized_headers(scope, max_header_bytes: int) -> Response | None:
    """The 431 to answer when the request's headers exceed `max_header_bytes`, else None."""
    if sum(len(k) + len(v) for k, v in scope["headers"]) <= max_header_bytes:
        return None
    return error_response(431, f"request headers exceed {max_header_bytes} bytes", "invalid_request_error")


class HeaderLimitMiddleware:
    def __init__(self, app, max_header_bytes: int):
        self.app = app
        self.max_header_bytes = max_header_bytes

    async def __call__(self, scope, receive, send):
        refusal = oversized_headers(scope, self.max_header_bytes) if scope["type"] == "http" else None
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            await refusal(scope, receive, send)
