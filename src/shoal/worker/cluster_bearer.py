"""What a worker asks of a caller of its cluster-internal endpoints: where the worker has the
cluster secret, the secret as the bearer token (compared in constant time); without one (a worker
that only its own parent process reaches), nothing."""

from __future__ import annotations

import hmac

from fastapi import Request

from shoal.errors import ShoalError
from shoal.protocol.cluster_secret import configured_secret


class UnauthorizedError(ShoalError):
    """A cluster-internal call without the cluster secret (401)."""

    status = 401
    error_type = "authentication_error"


def authorize(request: Request, action: str) -> None:
    """UnauthorizedError naming `action` unless the request carries the configured secret."""
    secret = configured_secret()
    if secret is None:
        return
    given = request.headers.get("authorization", "").removeprefix("Bearer ")
    if not hmac.compare_digest(given.encode(), secret.encode()):
        raise UnauthorizedError(f"{action} needs the cluster secret as the bearer token")
