"""What passes between the client and a worker unchanged: the forwarded request headers, and the
OpenAI-shaped error body every refusal of the router uses. Requests reach the workers through
shoal.router.streams.upstream_client."""

from __future__ import annotations

import logging

from starlette.responses import Response

from shoal.errors import error_json
from shoal.protocol.admission_class import PRIORITY_HEADER
from shoal.router.placement.route_request import RequestError

log = logging.getLogger(__name__)

# A client's headers a worker gets; the body the router sends is JSON it encoded itself, whatever
# content type its client named (or none, for requests the router makes itself, such as a batch's).
FORWARDED_HEADERS = ("traceparent", "tracestate", "x-request-id", PRIORITY_HEADER)
JSON_CONTENT = {"content-type": "application/json"}


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


def invalid_request(exc: RequestError) -> Response:
    """The 400 for a request the router found invalid: its message, naming its `param`."""
    return error_response(400, f"invalid request: {exc}", "invalid_request_error", exc.param)


def store_unavailable(exc: Exception) -> Response:
    """The 503 for a state store that could not be read or written (the router goes on)."""
    log.warning("state store unavailable: %s", exc)
    return error_response(503, str(exc), "service_unavailable", headers={"retry-after": "1"})
