"""The cluster secret: what every process of a cluster shares, and the keys derived from it.

It is read from $SHOAL_CLUSTER_SECRET. A process that only links to children it starts itself
(local pipeline stages, tensor-parallel followers, all on loopback) may run without one: it
draws a secret for the run and hands it to them in their environment. A process that serves or
reaches peers it did not start needs the configured one.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets

SECRET_ENV = "SHOAL_CLUSTER_SECRET"


class MissingClusterSecret(RuntimeError):
    """This process needs the cluster secret and none is configured."""


def configured_secret() -> str | None:
    return os.environ.get(SECRET_ENV) or None


def required_secret(who: str) -> str:
    """The configured secret; MissingClusterSecret naming `who` and the variable if there is none."""
    secret = configured_secret()
    if secret is None:
        raise MissingClusterSecret(
            f"{who} needs the cluster secret in ${SECRET_ENV} (the same on every process of the cluster)"
        )
    return secret


def run_secret() -> str:
    """The configured secret, else a fresh one for this run (to hand to child processes)."""
    return configured_secret() or secrets.token_urlsafe(32)


def child_environment(secret: str) -> dict[str, str]:
    """This process's environment, with `secret` as the cluster secret, for a child it starts."""
    return {**os.environ, SECRET_ENV: secret}


def derived_key(secret: str, purpose: str) -> bytes:
    """32 bytes derived from the secret for one purpose (HMAC-SHA256 keyed by the secret): keys for
    different purposes reveal nothing about each other or about the secret."""
    return hmac.new(secret.encode(), f"shoal/{purpose}".encode(), hashlib.sha256).digest()
