"""The KV events of one engine (shoal.protocol.kv_events): numbered as they happen, applied to the
engine's own KvState, and the last `retained` kept for the routers that follow it.

The block manager and the KV tier write from the engine's thread; the server's event loop reads.
Every method takes the one lock, so a reader sees a prefix of the numbered events and a snapshot
is the state after exactly its number.
"""

from __future__ import annotations

import secrets
import threading
from collections import deque
from collections.abc import Sequence
from itertools import islice

from shoal.protocol.kv_events import (
    BlocksRemoved,
    BlocksStored,
    Event,
    KvEvents,
    KvSnapshot,
    PromptMapped,
)
from shoal.protocol.kv_state import KvState

RETAINED_EVENTS = 1 << 16


class KvEventLog:
    """Invariant: `state` is the result of events 1..seq of `epoch` in order; the retained events
    are the last ones up to seq, numbered consecutively."""

    def __init__(self, retained: int = RETAINED_EVENTS):
        self.epoch = secrets.token_hex(8)
        self.state = KvState()
        self._lock = threading.Lock()
        self._events: deque[Event] = deque(maxlen=retained)
        self._seq = 0

    def stored(self, level: int, digests: Sequence[bytes]) -> None:
        if digests:
            self._publish(BlocksStored(level, list(digests)))

    def removed(self, level: int, digests: Sequence[bytes]) -> None:
        if digests:
            self._publish(BlocksRemoved(level, list(digests)))

    def mapped(self, chain: Sequence[bytes], keys: Sequence[bytes], blocks: Sequence[int]) -> None:
        if chain and keys:
            self._publish(PromptMapped(list(chain), list(keys), list(blocks)))

    def _publish(self, event: Event) -> None:
        with self._lock:
            self._seq += 1
            self._events.append(event)
            self.state.apply(event)

    def read(self, after: int) -> KvEvents | None:
        """The events after number `after` (none when it is the last), or None when some of them are
        no longer retained (or `after` is past the last): the reader needs a snapshot."""
        with self._lock:
            oldest = self._seq - len(self._events) + 1
            if not oldest - 1 <= after <= self._seq:
                return None
            return KvEvents(self.epoch, after + 1, list(islice(self._events, after + 1 - oldest, None)))

    def snapshot(self) -> KvSnapshot:
        with self._lock:
            return self.state.snapshot(self.epoch, self._seq)
