"""What a router knows each worker caches from the worker's KV events (shoal.protocol.kv_state),
and which workers' states name each prefix key, so that a request's candidates that hold none of
its keys are passed over without a look at their states (a fleet of a thousand workers holds a
prompt on a few).
"""

from __future__ import annotations

from shoal.protocol.kv_events import KvEvents, KvSnapshot
from shoal.protocol.kv_state import KvState

# A state from which no frame came for this long is not trusted (a worker sends one every 2 s).
STALE_S = 6.0


class WorkerFeed:
    """One worker's followed state. Invariant: `state` is None, or the worker's state after event
    `seq` of `epoch`; `keys_changed` has been told of exactly the keys `state` maps."""

    def __init__(self, keys_changed=None) -> None:
        self.state: KvState | None = None
        self.epoch = ""
        self.seq = -1
        self.received = 0.0
        self.keys_changed = keys_changed

    def apply(self, frame: KvEvents | KvSnapshot, now: float) -> bool:
        """Applies a frame received at `now` (the caller's clock, which `fresh_state` is asked in);
        False when it does not follow (a gap or another epoch): start over."""
        self.received = now
        if isinstance(frame, KvSnapshot):
            self.clear()
            self.state = KvState.from_snapshot(frame, keys_changed=self.keys_changed)
            self.epoch, self.seq = frame.epoch, frame.seq
            return True
        if self.state is None or frame.epoch != self.epoch or frame.first != self.seq + 1:
            self.clear()
            return False
        for event in frame.events:
            self.state.apply(event)
        self.seq += len(frame.events)
        return True

    def clear(self) -> None:
        """Forgets the state (its keys told as gone)."""
        if self.state is not None and self.keys_changed is not None:
            for key in self.state.key_block:
                self.keys_changed(key, False)
        self.state, self.seq = None, -1

    def fresh_state(self, now: float) -> KvState | None:
        return self.state if self.state is not None and now - self.received < STALE_S else None


class FollowedCaches:
    """Invariant: `_holders[key]` is the set of workers whose feed's state maps `key` (no empty sets)."""

    def __init__(self) -> None:
        self.feeds: dict[str, WorkerFeed] = {}
        self._holders: dict[bytes, set[str]] = {}

    def feed(self, worker_id: str) -> WorkerFeed:
        """The worker's feed, a new one the first time."""
        feed = self.feeds.get(worker_id)
        if feed is None:
            feed = self.feeds[worker_id] = WorkerFeed(lambda key, added: self._changed(worker_id, key, added))
        return feed

    def drop(self, worker_id: str) -> None:
        feed = self.feeds.pop(worker_id, None)
        if feed is not None:
            feed.clear()

    def state_of(self, worker_id: str, now: float) -> KvState | None:
        """The worker's followed state, or None where it publishes none or it is stale."""
        feed = self.feeds.get(worker_id)
        return feed.fresh_state(now) if feed is not None else None

    def holding(self, keys: tuple[bytes, ...]) -> set[str]:
        """The workers whose states name any of `keys`."""
        found: set[str] = set()
        for key in keys:
            holders = self._holders.get(key)
            if holders:
                found |= holders
        return found

    def _changed(self, worker_id: str, key: bytes, added: bool) -> None:
        if added:
            self._holders.setdefault(key, set()).add(worker_id)
            return
        holders = self._holders.get(key)
        if holders is not None:
            holders.discard(worker_id)
            if not holders:
                del self._holders[key]
