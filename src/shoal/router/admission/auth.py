"""Client authentication: API keys as Bearer tokens (or in Anthropic's x-api-key header), stored
as SHA-256 hashes (or given raw in an environment variable), each with optional rate limits. Keys
never appear in logs: a key is named by its configured name, or by the first 8 hex digits of its
hash."""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Mapping
from dataclasses import dataclass

from shoal.router.config import ApiKey, LatencyTargets, RateLimits, RouterConfig


@dataclass(frozen=True)
class Client:
    """Who is calling, as far as limits and logs are concerned."""

    name: str
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    end_user_requests_per_minute: int | None = None
    end_user_tokens_per_minute: int | None = None
    weight: float = 1.0  # its fair share of the slots (admission)
    targets: LatencyTargets = LatencyTargets()  # its requests' latency targets unless headers set them

    def tenant(self, end_user: str | None) -> str:
        """Whom fair shares count a request for: the client, or its end user where it names one."""
        return self.name if end_user is None else f"{self.name}/{end_user}"

    def limits(self, end_user: str | None) -> list[tuple[str, int | None, int | None]]:
        """The rate limits a request of this client counts against (RateLimiter.check): its own, and
        its end user's where it names one."""
        own = [(self.name, self.requests_per_minute, self.tokens_per_minute)]
        if end_user is None:
            return own
        return [*own, (self.tenant(end_user), self.end_user_requests_per_minute, self.end_user_tokens_per_minute)]


def key_hash(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def authorization(headers: Mapping[str, str]) -> str | None:
    """The credential a request presents, as an Authorization value: its Authorization header,
    else its x-api-key (Anthropic's SDK sends the key there) as a Bearer token."""
    if "authorization" in headers:
        return headers["authorization"]
    key = headers.get("x-api-key")
    return f"Bearer {key}" if key else None


# Keys recently accepted, by the Authorization value as sent: a client's next request skips the hash.
KNOWN_KEYS = 1024


class ApiKeys:
    """Invariant: open (every caller is "anonymous") exactly when no key is configured. Each key's
    Client is built once; `known` holds at most KNOWN_KEYS accepted Authorization values, each with
    the Client its key's hash matched (a wrong key is hashed every time)."""

    def __init__(self, config: RouterConfig):
        keys = list(config.api_keys)
        raw = os.environ.get(config.api_keys_env, "") if config.api_keys_env else ""
        keys += [ApiKey(sha256=key_hash(k.strip())) for k in raw.split(",") if k.strip()]
        default = config.default_rate_limits
        self.anonymous = Client("anonymous", *_limits(default, default))
        self.clients = [
            (
                bytes.fromhex(key.sha256),
                Client(
                    key.name or f"key-{key.sha256[:8]}", *_limits(key, default), weight=key.weight, targets=key.targets
                ),
            )
            for key in keys
        ]
        self.known: dict[str, Client] = {}

    @property
    def open(self) -> bool:
        return not self.clients

    def named(self, name: str) -> Client | None:
        """The client of that name (work the router does later for a client, such as a batch, runs
        as it), or None once its key is no longer configured."""
        if self.open:
            return self.anonymous if name == self.anonymous.name else None
        return next((client for _, client in self.clients if client.name == name), None)

    def authenticate(self, authorization: str | None) -> Client | None:
        """The caller for an Authorization header value, or None if it is missing or wrong."""
        if self.open:
            return self.anonymous
        known = self.known.get(authorization) if authorization else None
        if known is not None:
            return known
        if not authorization or not authorization.startswith("Bearer "):
            return None
        offered = hashlib.sha256(authorization.removeprefix("Bearer ").strip().encode()).digest()
        for digest, client in self.clients:
            if hmac.compare_digest(offered, digest):
                if len(self.known) >= KNOWN_KEYS:
                    self.known.clear()
                self.known[authorization] = client
                return client
        return None


def _limits(key: RateLimits, default: RateLimits) -> tuple[int | None, ...]:
    """A key's limits, each falling back to the default's."""
    names = ("requests_per_minute", "tokens_per_minute", "end_user_requests_per_minute", "end_user_tokens_per_minute")
    return tuple(getattr(key, name) or getattr(default, name) for name in names)
