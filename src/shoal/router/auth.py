"""Client authentication: API keys as Bearer tokens, stored as SHA-256 hashes (or given raw in an
environment variable), each with optional rate limits. Keys never appear in logs: a key is named
by its configured name, or by the first 8 hex digits of its hash."""

from __future__ import annotations

import hashlib
import hmac
import os
from dataclasses import dataclass

from shoal.router.config import ApiKey, RouterConfig


@dataclass(frozen=True)
class Client:
    """Who is calling, as far as limits and logs are concerned."""

    name: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class ApiKeys:
    """Invariant: open (every caller is "anonymous") exactly when no key is configured."""

    def __init__(self, config: RouterConfig):
        keys = list(config.api_keys)
        raw = os.environ.get(config.api_keys_env, "") if config.api_keys_env else ""
        keys += [ApiKey(sha256=key_hash(k.strip())) for k in raw.split(",") if k.strip()]
        self.keys = keys
        self.default = config.default_rate_limits

    @property
    def open(self) -> bool:
        return not self.keys

    def authenticate(self, authorization: str | None) -> Client | None:
        """The caller for an Authorization header value, or None if it is missing or wrong."""
        if self.open:
            return Client("anonymous", self.default.requests_per_minute, self.default.tokens_per_minute)
        if not authorization or not authorization.startswith("Bearer "):
            return None
        offered = key_hash(authorization.removeprefix("Bearer ").strip())
        for key in self.keys:
            if hmac.compare_digest(offered, key.sha256):
                return Client(
                    key.name or f"key-{key.sha256[:8]}",
                    key.requests_per_minute or self.default.requests_per_minute,
                    key.tokens_per_minute or self.default.tokens_per_minute,
                )
        return None
