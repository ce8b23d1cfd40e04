"""Per-key rate limits, and per end user of a key: requests per minute and tokens per minute, as
token buckets.

A bucket holds up to `per_minute` units and refills continuously at per_minute / 60 per second. A
request takes 1 request unit and its estimated tokens (prompt + max output) from the key's buckets,
or nothing at all if either would go negative; the refusal says how long until it would fit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass
class TokenBucket:
    per_minute: float
    level: float = -1.0
    updated: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        if self.level < 0:
            self.level = self.per_minute

    def refill(self, now: float) -> None:
        self.level = min(self.per_minute, self.level + (now - self.updated) * self.per_minute / 60.0)
        self.updated = now

    def seconds_until(self, amount: float) -> float:
        """0 if `amount` fits now; otherwise the wait (infinite if it can never fit)."""
        if amount <= self.level:
            return 0.0
        if amount > self.per_minute:
            return float("inf")
        return (amount - self.level) * 60.0 / self.per_minute


class RateLimiter:
    """Invariant: buckets only ever lose what an admitted request took."""

    def __init__(self):
        self.buckets: dict[tuple[str, str], TokenBucket] = {}

    def check(self, limits: list[tuple[str, float | None, float | None]], tokens: int) -> float:
        """For each (key, requests_per_minute, tokens_per_minute) of `limits` (a limit None is none):
        takes from every key's buckets and returns 0, or takes nothing and returns seconds to wait."""
        now = time.monotonic()
        buckets = []
        for key, requests_per_minute, tokens_per_minute in limits:
            for kind, limit, amount in (("requests", requests_per_minute, 1), ("tokens", tokens_per_minute, tokens)):
                if limit:
                    bucket = self.buckets.get((key, kind))
                    if bucket is None:  # full, as of now
                        bucket = self.buckets[(key, kind)] = TokenBucket(limit, updated=now)
                    bucket.refill(now)
                    buckets.append((bucket, amount))
        wait = max((b.seconds_until(a) for b, a in buckets), default=0.0)
        if wait == 0.0:
            for bucket, amount in buckets:
                bucket.level -= amount
        return wait
