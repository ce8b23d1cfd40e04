"""Errors in Anthropic's shape, `{"type": "error", "error": {"type", "message"}}`, for the Messages
API: its own refusals, and the router's OpenAI-shaped ones (admission, placement, the workers')
rewritten with the same status, message and headers."""

from __future__ import annotations

import json

from starlette.responses import Response

# Anthropic's error type for each status it uses; any other status is an api_error.
ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_type(status: object) -> str:
    return ERROR_TYPES.get(status, "api_error") if isinstance(status, int) else "api_error"


def error_body(status: object, message: str) -> dict:
    return {"type": "error", "error": {"type": error_type(status), "message": message}}


def anthropic_error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return Response(
        json.dumps(error_body(status, message)).encode(),
        status_code=status,
        media_type="application/json",
        headers=headers,
    )


def anthropic_shaped(response: Response) -> Response:
    """An OpenAI-shaped error response of the router as Anthropic's: same status, message and
    headers (retry-after, x-shoal-*), content-length and type recomputed."""
    try:
        message = json.loads(response.body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.body.decode(errors="replace")
    kept = {k: v for k, v in response.headers.items() if k not in ("content-length", "content-type")}
    return anthropic_error(response.status_code, message, kept)
