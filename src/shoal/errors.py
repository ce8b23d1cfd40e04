"""Typed errors shared by every layer. Invalid input never takes the engine down: it raises one of
these for the offending request only."""
from __future__ import annotations


class ShoalError(Exception):
    """Base of all errors shoal raises on purpose."""


class InvalidRequestError(ShoalError, ValueError):
    """The request itself is wrong (maps to HTTP 400). `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param


class PromptTooLongError(InvalidRequestError):
    """Prompt plus requested output cannot fit the model's context window or the KV cache."""


class EmptyPromptError(InvalidRequestError):
    """The prompt has no tokens."""


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range."""


class DuplicateRequestError(InvalidRequestError):
    """A request with this id is already running."""


class EngineRequestError(ShoalError):
    """The engine failed while computing this request (maps to HTTP 500); other requests go on."""


class ReplicaFailedError(ShoalError):
    """A process the replica is made of (a tensor-parallel rank, a pipeline stage with no
    replacement) is gone: no request can run here any more; the router moves them elsewhere."""
