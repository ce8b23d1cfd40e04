"""A simulated KV tier under a simulated worker's block manager (shoal.engine.kv_tier's levels and
policy, without the bytes): evicted blocks go to a host level, its least recently used to a disk
level; a block found there is copied back at the level's load rate, which the worker's next step
pays for. A failed worker loses its host level and keeps its disk.

Rates default to what copying SmolLM2-135M's bfloat16 KV (about 23 KB a token) costs on the
2-core machines of docs/simulation.md: memory at about 5 GB/s, a local file through the page
cache at about 1 GB/s. They are estimates: set them per worker class.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

from shoal.engine.kv_event_log import KvEventLog
from shoal.protocol.kv_events import LEVELS

DEFAULT_HOST_TOKENS_PER_S = 200_000.0
DEFAULT_DISK_TOKENS_PER_S = 40_000.0


class SimulatedTier:
    """Invariant: a block is in at most one level; each level holds at most its capacity."""

    def __init__(self, block_size: int, host_tokens: int, disk_tokens: int, host_rate: float, disk_rate: float):
        self.block_size = block_size
        self.capacity = {"host": host_tokens // block_size, "disk": disk_tokens // block_size}
        self.rate = {"host": host_rate, "disk": disk_rate}
        self.levels: dict[str, OrderedDict[bytes, None]] = {"host": OrderedDict(), "disk": OrderedDict()}
        self.hits: Counter[str] = Counter()
        self.misses = 0
        self.pending_load_s = 0.0
        self.events: KvEventLog | None = None

    def publish_to(self, events: KvEventLog) -> None:
        """From now on the levels' changes go to `events`, starting with what they hold."""
        self.events = events
        for level, held in self.levels.items():
            events.stored(LEVELS[level], list(held))

    def spill(self, digest: bytes, block: int) -> None:
        self._put("host", digest)

    def _put(self, level: str, digest: bytes) -> None:
        if self.capacity[level] == 0:
            if level == "host":
                self._put("disk", digest)
            return
        held = self.levels[level]
        if digest not in held and self.events is not None:
            self.events.stored(LEVELS[level], [digest])
        held[digest] = None
        held.move_to_end(digest)
        if len(held) > self.capacity[level]:
            old, _ = held.popitem(last=False)
            if self.events is not None:
                self.events.removed(LEVELS[level], [old])
            if level == "host":
                self._put("disk", old)

    def fetch(self, digest: bytes) -> str | None:
        """The level that holds the block (a hit; it leaves the tier for the paged cache), or None."""
        for level in ("host", "disk"):
            if digest in self.levels[level]:
                del self.levels[level][digest]
                if self.events is not None:
                    self.events.removed(LEVELS[level], [digest])
                self.hits[level] += 1
                self.pending_load_s += self.block_size / self.rate[level]
                return level
        self.misses += 1
        return None

    def write(self, block: int, data: str) -> None:
        """Nothing to copy: the cost was counted by fetch."""

    def take_load_seconds(self) -> float:
        """The copying owed since the last step (and no more)."""
        owed, self.pending_load_s = self.pending_load_s, 0.0
        return owed

    def lose_host(self) -> None:
        """The worker failed: its host level is gone (its next event log starts without it)."""
        self.levels["host"].clear()
        self.pending_load_s = 0.0

    @property
    def capacity_tokens(self) -> int:
        return (self.capacity["host"] + self.capacity["disk"]) * self.block_size

    @property
    def load_tokens_per_s(self) -> float:
        return self.rate["host"] if self.capacity["host"] else self.rate["disk"]
