"""What one worker's prefix cache holds, kept from its KV events (shoal.protocol.kv_events): by the
worker itself, which publishes them, and by each router that follows it. Applying the same events
in the same order gives equal states; a snapshot of one state rebuilds it exactly.

`matched` answers a router's question: of a request's prefix keys, how many leading ones does this
worker hold every block for (at any level), and how many of those name a block not on the device
(one its KV tier must bring back).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from shoal.protocol.kv_events import (
    DEVICE,
    BlocksRemoved,
    BlocksStored,
    Event,
    KvSnapshot,
    PromptMapped,
)

# Mapped blocks not held yet (a prompt announced, its blocks not computed): the most remembered.
MAX_UNHELD = 1 << 16


class KvState:
    """Invariants: each block of `levels` has at least one level bit; every key names a block of
    `parents`; each block of `parents` is held or in `unheld` (the last max_unheld mapped blocks not
    held, least recently unheld first), and leaves `parents` (with the keys naming it) when it is
    pushed out of `unheld`: a block evicted and computed again keeps its keys."""

    def __init__(self, max_unheld: int = MAX_UNHELD, keys_changed: Callable[[bytes, bool], None] | None = None):
        self.max_unheld = max_unheld
        # Told of each key as it comes to name a block (True) and as it stops (False).
        self.keys_changed = keys_changed
        self.levels: dict[bytes, int] = {}
        self.parents: dict[bytes, bytes] = {}
        self.key_block: dict[bytes, bytes] = {}
        self._keys_of: dict[bytes, set[bytes]] = {}
        self.unheld: OrderedDict[bytes, None] = OrderedDict()

    def apply(self, event: Event) -> None:
        if isinstance(event, BlocksStored):
            for digest in event.digests:
                self.levels[digest] = self.levels.get(digest, 0) | event.level
                self.unheld.pop(digest, None)
        elif isinstance(event, BlocksRemoved):
            for digest in event.digests:
                self._remove(digest, event.level)
        else:
            self._map(event)

    def _remove(self, digest: bytes, level: int) -> None:
        levels = self.levels.get(digest, 0) & ~level
        if levels:
            self.levels[digest] = levels
        elif self.levels.pop(digest, None) is not None and digest in self.parents:
            self._unhold(digest)

    def _unhold(self, digest: bytes) -> None:
        """A mapped block is not held (any more, or yet): remembered among the newest unheld."""
        self.unheld[digest] = None
        self.unheld.move_to_end(digest)
        while len(self.unheld) > self.max_unheld:
            self._forget(self.unheld.popitem(last=False)[0])

    def _map(self, event: PromptMapped) -> None:
        parent = b""
        for digest in event.chain:
            self.parents[digest] = parent
            parent = digest
        for key, blocks in zip(event.keys, event.blocks):
            if blocks <= len(event.chain):
                digest = event.chain[blocks - 1]
                if self.keys_changed is not None and key not in self.key_block:
                    self.keys_changed(key, True)
                self.key_block[key] = digest
                self._keys_of.setdefault(digest, set()).add(key)
        for digest in event.chain:
            if digest not in self.levels:
                self._unhold(digest)

    def _forget(self, digest: bytes) -> None:
        self.parents.pop(digest, None)
        self.unheld.pop(digest, None)
        for key in self._keys_of.pop(digest, ()):
            if self.key_block.get(key) == digest:
                del self.key_block[key]
                if self.keys_changed is not None:
                    self.keys_changed(key, False)

    def matched(self, keys: Sequence[bytes]) -> tuple[int, int]:
        """How many leading `keys` this worker holds every block for, and how many of those name a
        block held only below the device."""
        held: set[bytes] = set()
        matched, off_device = 0, 0
        for index, key in enumerate(keys):
            digest = self.key_block.get(key)
            if digest is None:
                continue
            if not self._chain_held(digest, held):
                break
            matched = index + 1
            off_device += not self.levels[digest] & DEVICE
        return matched, off_device

    def _chain_held(self, digest: bytes, held: set[bytes]) -> bool:
        """Whether the block and each of its ancestors is held (`held`: blocks already found so)."""
        walked = []
        while digest and digest not in held:
            parent = self.parents.get(digest)
            if digest not in self.levels or parent is None:
                return False
            walked.append(digest)
            digest = parent
        held.update(walked)
        return True

    def snapshot(self, epoch: str, seq: int) -> KvSnapshot:
        return KvSnapshot(
            epoch=epoch,
            seq=seq,
            held=list(self.levels.items()),
            parents=list(self.parents.items()),
            keys=list(self.key_block.items()),
            unheld=list(self.unheld),
        )

    @classmethod
    def from_snapshot(
        cls,
        snapshot: KvSnapshot,
        max_unheld: int = MAX_UNHELD,
        keys_changed: Callable[[bytes, bool], None] | None = None,
    ) -> KvState:
        state = cls(max_unheld, keys_changed)
        state.levels = dict(snapshot.held)
        state.parents = dict(snapshot.parents)
        state.unheld = OrderedDict.fromkeys(snapshot.unheld)
        for key, digest in snapshot.keys:
            state.key_block[key] = digest
            state._keys_of.setdefault(digest, set()).add(key)
            if keys_changed is not None:
                keys_changed(key, True)
        return state

    def same_as(self, other: KvState) -> bool:
        return (
            self.levels == other.levels
            and self.parents == other.parents
            and self.key_block == other.key_block
            and list(self.unheld) == list(other.unheld)
        )
