"""The one error tree, shared by every layer, and the one function that builds an error body.

Every error shoal raises on purpose knows its HTTP status and OpenAI error type (and, where OpenAI
has one, its code: `context_length_exceeded`). Invalid input never takes the engine down: it
raises one of these for the offending request only. Imports nothing: the router uses it too.
"""

from __future__ import annotations

import json
from typing import Any


def error_body(
    message: str, status: int, error_type: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    """OpenAI's error envelope. `code` defaults to the HTTP status, as vLLM answers."""
    return {"error": {"message": message, "type": error_type, "param": param, "code": status if code is None else code}}


def error_json(
    message: str, status: int, error_type: str, param: str | None = None, code: str | int | None = None
) -> bytes:
    return json.dumps(error_body(message, status, error_type, param, code)).encode()


class ShoalError(Exception):
    """Base of all errors shoal raises on purpose. Class attributes: `status` (HTTP), `error_type`
    (OpenAI's `type`), `code` (OpenAI's `code`, None for the status)."""

    status = 500
    error_type = "internal_error"
    code: str | None = None

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.status, self.error_type, self.param, self.code)


class InvalidRequestError(ShoalError, ValueError):
    """The request itself is wrong (400). `param` names the offending field."""

    status = 400
    error_type = "invalid_request_error"


class ModelNotFoundError(InvalidRequestError):
    """The request names a model that is not served here (404)."""

    status = 404
    error_type = "not_found_error"


class PromptTooLongError(InvalidRequestError):
    """Prompt plus requested output cannot fit the model's context window or the KV cache."""

    code = "context_length_exceeded"


class EmptyPromptError(InvalidRequestError):
    """The prompt has no tokens."""


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range."""


class DuplicateRequestError(InvalidRequestError):
    """A request with this id is already running."""


class EngineRequestError(ShoalError):
    """The engine failed while computing this request (500); other requests go on."""


class ReplicaFailedError(ShoalError):
    """A process the replica is made of (a tensor-parallel rank, a pipeline stage with no
    replacement) is gone: no request can run here any more; the router moves them elsewhere (503)."""

    status = 503
    error_type = "service_unavailable"
