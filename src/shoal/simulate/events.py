"""The simulation's clock: a priority queue of timed callbacks."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable


class EventLoop:
    """Runs callbacks in order of time; callbacks at equal times run in the order they were
    scheduled. Invariant: `now` never decreases, and no callback is scheduled in the past."""

    def __init__(self) -> None:
        self.now = 0.0
        self._queue: list[tuple[float, int, Callable, tuple]] = []
        self._order = itertools.count()
        self._stopped = False
        self.events_run = 0

    def at(self, time: float, callback: Callable, *args) -> None:
        if time < self.now:
            raise ValueError(f"cannot schedule at {time} before now ({self.now})")
        heapq.heappush(self._queue, (time, next(self._order), callback, args))

    def after(self, delay: float, callback: Callable, *args) -> None:
        self.at(self.now + delay, callback, *args)

    def stop(self) -> None:
        """Ends `run` once the current callback returns (periodic events never empty the queue)."""
        self._stopped = True

    def run(self) -> None:
        """Runs events until `stop` is called or none is left."""
        queue, pop = self._queue, heapq.heappop
        while queue and not self._stopped:
            time, _, callback, args = pop(queue)
            self.now = time
            callback(*args)
            self.events_run += 1
