"""Worker failures: exponential times to failure, fixed repair times."""

from __future__ import annotations

import random

from shoal.simulate.events import EventLoop
from shoal.simulate.router import SimRouter
from shoal.simulate.worker import SimWorker


class FailureProcess:
    """A worker whose class has an `mtbf` fails after an exponential time of that mean (counted
    from when it last came up), stays down for its `repair` seconds, then serves again with an
    empty cache. Invariant: `failures` counts the failures so far."""

    def __init__(self, loop: EventLoop, router: SimRouter, rng: random.Random):
        self.loop = loop
        self.router = router
        self.rng = rng
        self.failures = 0

    def watch(self, worker: SimWorker) -> None:
        if worker.spec.mtbf_s is not None:
            self.loop.after(self.rng.expovariate(1.0 / worker.spec.mtbf_s), self._fail, worker)

    def _fail(self, worker: SimWorker) -> None:
        self.failures += 1
        self.router.worker_failed(worker)
        self.loop.after(worker.spec.repair_s, self._recover, worker)

    def _recover(self, worker: SimWorker) -> None:
        self.router.worker_recovered(worker)
        self.watch(worker)
