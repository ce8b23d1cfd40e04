"""The prompt blocks a router sent to each worker that the worker's KV events may not show yet.

Events tell what a worker has computed; a request placed a moment ago has not been computed, and
one that ended a moment ago may have stored events still on their way. So, as Dynamo's router
tracks its active blocks, the router keeps each worker's blocks of requests in flight, and of those
that ended within GRACE_S (longer than an event takes to arrive), and counts them as held there.
"""

from __future__ import annotations

from collections import Counter, OrderedDict

GRACE_S = 1.0


class InFlightPrefixes:
    """Invariant: `_flying[w]` counts each block over the requests in flight on worker w that carry
    it; `_landed[w]` maps blocks of requests that ended there to when they stop counting, soonest
    first."""

    def __init__(self) -> None:
        self._flying: dict[str, Counter[bytes]] = {}
        self._landed: dict[str, OrderedDict[bytes, float]] = {}

    def sent(self, worker_id: str, blocks: tuple[bytes, ...]) -> None:
        self._flying.setdefault(worker_id, Counter()).update(blocks)

    def ended(self, worker_id: str, blocks: tuple[bytes, ...], now: float) -> None:
        flying = self._flying.get(worker_id)
        if flying is None:
            return
        flying.subtract(blocks)
        landed = self._landed.setdefault(worker_id, OrderedDict())
        for block in blocks:
            if flying[block] <= 0:
                del flying[block]
            landed[block] = now + GRACE_S
            landed.move_to_end(block)

    def leading(self, worker_id: str, blocks: tuple[bytes, ...], now: float) -> int:
        """How many leading `blocks` the worker was sent by requests in flight or just ended."""
        landed = self._landed.get(worker_id)
        while landed and next(iter(landed.values())) <= now:
            landed.popitem(last=False)
        flying = self._flying.get(worker_id, {})
        count = 0
        for block in blocks:
            if block not in flying and not (landed and block in landed):
                break
            count += 1
        return count

    def forget(self, worker_id: str) -> None:
        self._flying.pop(worker_id, None)
        self._landed.pop(worker_id, None)
