"""What passes between the client and a worker unchanged: the forwarded request headers, and the
OpenAI-shaped error body every refusal of the router uses. Requests reach the workers through
router.upstream_client."""

from __future__ import annotations

from starlette.responses import Response

from shoal.errors import error_json

FORWARDED_HEADERS = ("content-type", "traceparent", "tracestate", "x-request-id")


def error_response(
    status: int,
    message: str,
    kind: str,
    param: str | None = None,
    headers: dict[str, str] | None = None,
    code: str | None = None,
) -> Response:
    return Response(
        error_json(message, status, kind, param, code),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )
