"""CPU sharing: the workers on one host compete for its cores (processor sharing)."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from shoal.simulate.events import EventLoop


@dataclass
class _Step:
    remaining_s: float  # work left, in seconds at full speed
    threads: int
    on_done: Callable[[], None]
    token: int


class Host:
    """A machine with `cores` cores running the steps of its workers. While the threads stepping
    there outnumber its cores, every step progresses at cores / threads of full speed; the rates
    change whenever a step starts or ends, and the finish times with them.

    Invariant: each worker has at most one step in progress; the scheduled finish of a step is
    valid only while its token is the latest (older finish events are ignored)."""

    def __init__(self, name: str, cores: float, loop: EventLoop):
        self.name = name
        self.cores = cores
        self.loop = loop
        self._steps: dict[str, _Step] = {}
        self._tokens = itertools.count()
        self._rate = 1.0
        self._since = 0.0

    def start(self, worker_id: str, threads: int, work_s: float, on_done: Callable[[], None]) -> None:
        """Runs a step of `work_s` seconds at full speed; `on_done()` when it has finished."""
        assert worker_id not in self._steps, f"{worker_id} already has a step on {self.name}"
        self._advance()
        step = self._steps[worker_id] = _Step(work_s, threads, on_done, 0)
        if not self._rate_changed():
            self._schedule(worker_id, step)

    def cancel(self, worker_id: str) -> None:
        """Drops the worker's step, if any (the worker failed)."""
        if worker_id in self._steps:
            self._advance()
            del self._steps[worker_id]
            self._rate_changed()

    def _advance(self) -> None:
        elapsed = self.loop.now - self._since
        if elapsed and self._steps:
            for step in self._steps.values():
                step.remaining_s = max(0.0, step.remaining_s - elapsed * self._rate)
        self._since = self.loop.now

    def _rate_changed(self) -> bool:
        """Sets the rate for the steps in progress; if it changed, schedules all their finishes again."""
        threads = sum(step.threads for step in self._steps.values())
        rate = min(1.0, self.cores / threads) if threads else 1.0
        if rate == self._rate:
            return False
        self._rate = rate
        for worker_id, step in self._steps.items():
            self._schedule(worker_id, step)
        return True

    def _schedule(self, worker_id: str, step: _Step) -> None:
        step.token = next(self._tokens)
        self.loop.after(step.remaining_s / self._rate, self._finish, worker_id, step.token)

    def _finish(self, worker_id: str, token: int) -> None:
        step = self._steps.get(worker_id)
        if step is None or step.token != token:
            return
        self._advance()
        del self._steps[worker_id]
        self._rate_changed()
        step.on_done()
