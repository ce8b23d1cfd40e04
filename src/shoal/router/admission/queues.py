"""Admission control: a bounded number of requests in flight per model, and bounded queues per
priority class for the rest.

Classes, in order: critical, standard, sheddable. A request is admitted at once if its model has a
free slot and nobody of its class or a higher one is waiting for that model; otherwise it waits in
its class's queue until a slot frees or its queue timeout passes (503 + Retry-After); within a class
the next slot goes to the tenant (an API key, or one end user of a key) that has been admitted the
fewest tokens for its weight (shoal.router.admission.fair_share), first come first served within a tenant. A full
queue refuses with 429 + Retry-After, except for critical requests, which evict the newest waiting
sheddable request, then the newest standard one, and are refused only when neither exists. So a
critical request is never shed while a lower-class one is still queued. Below them all, batch work
never queues: it is admitted only while its model has a free slot and nobody waits for the model
at all, else refused at once (429), and its runner tries again later.
"""

from __future__ import annotations

import asyncio
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from shoal.router.admission.fair_share import FairShare
from shoal.router.admission.slots import GroupSlots, LocalSlots

PRIORITY_ORDER = ("critical", "standard", "sheddable")
BATCH = "batch"  # below every queued class (route_request.BATCH_PRIORITY)


class Refused(Exception):
    """Not admitted: `status` is 429 (queue full, shed) or 503 (timed out waiting)."""

    def __init__(self, status: int, message: str, retry_after_s: int):
        super().__init__(message)
        self.status = status
        self.retry_after_s = retry_after_s


class Share(msgspec.Struct, frozen=True):
    """Who a request is for, as fair shares count it: its tenant, its estimated tokens, the tenant's
    weight (a msgspec struct: one is built for every request)."""

    tenant: str = ""
    tokens: int = 1
    weight: float = 1.0


ANONYMOUS = Share()  # a request counted for no tenant in particular


@dataclass
class Waiter:
    model: str
    priority: str
    admitted: asyncio.Future
    share: Share


class Admission:
    """Invariants: slots.held(m) counts requests of model m holding a slot (admitted, not released;
    across the router group when slots are GroupSlots); it exceeds capacity(m) only when capacity
    shrank under it; every queued waiter's future is pending. `released`, when set, hears of every
    slot given back (a router group tells its other members, whose queues may take it)."""

    def __init__(
        self,
        capacity: Callable[[str], int],
        queue_limits: dict[str, int],
        queue_timeout_s: float,
        retry_after_s: int = 2,
        slots: LocalSlots | GroupSlots | None = None,
    ):
        self.capacity = capacity
        self.queue_limits = queue_limits
        self.queue_timeout_s = queue_timeout_s
        self.retry_after_s = retry_after_s
        self.slots = slots if slots is not None else LocalSlots()
        self.released: Callable[[str], None] | None = None
        self.queues: dict[str, deque[Waiter]] = {p: deque() for p in PRIORITY_ORDER}
        self.shed: Counter[str] = Counter()
        self.fair = FairShare()

    def has_room(self, model: str) -> bool:
        return self.slots.held(model) < self.capacity(model)

    def _waiting_ahead(self, model: str, priority: str) -> bool:
        if not any(self.queues.values()):  # the common case: nobody waits
            return False
        ahead = PRIORITY_ORDER if priority == BATCH else PRIORITY_ORDER[: PRIORITY_ORDER.index(priority) + 1]
        return any(w.model == model for p in ahead for w in self.queues[p])

    def try_admit(self, model: str, priority: str, share: Share = ANONYMOUS) -> bool:
        """Takes a slot if one is free and nobody of this priority or above waits for the model."""
        if self._waiting_ahead(model, priority) or not self.slots.try_take(model, self.capacity(model)):
            return False
        self.fair.charge(share.tenant, share.tokens, share.weight)
        return True

    async def admit(self, model: str, priority: str, timeout_s: float | None = None, share: Share = ANONYMOUS) -> None:
        """Returns once the request holds a slot (release() it afterwards), waiting at most
        timeout_s (default: the queue timeout); raises Refused."""
        timeout_s = self.queue_timeout_s if timeout_s is None else timeout_s
        if self.try_admit(model, priority, share):
            return
        if priority == BATCH:
            self.shed[priority] += 1
            raise Refused(429, f"no idle capacity for batch work on {model!r} now", self.retry_after_s)
        queue = self.queues[priority]
        if len(queue) >= self.queue_limits[priority] and not (priority == "critical" and self._evict_lower()):
            self.shed[priority] += 1
            raise Refused(429, f"the {priority} queue is full; try again later", self.retry_after_s)
        waiter = Waiter(model, priority, asyncio.get_running_loop().create_future(), share)
        if not any(w.share.tenant == share.tenant for q in self.queues.values() for w in q):
            self.fair.lift(share.tenant)
        queue.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.admitted), timeout_s)
        except TimeoutError:
            if waiter in queue:
                queue.remove(waiter)
            if not waiter.admitted.done():
                self.shed[priority] += 1
                raise Refused(503, f"no capacity for {model!r} within {timeout_s:g} s", self.retry_after_s) from None
        except asyncio.CancelledError:  # the client went away while queued
            if waiter in queue:
                queue.remove(waiter)
            elif waiter.admitted.done() and not waiter.admitted.exception():
                self.release(model)
            raise
        waiter.admitted.result()  # raises Refused if it was evicted

    def _evict_lower(self) -> bool:
        for priority in reversed(PRIORITY_ORDER[1:]):
            if self.queues[priority]:
                victim = self.queues[priority].pop()
                self.shed[priority] += 1
                victim.admitted.set_exception(
                    Refused(429, "shed for higher-priority work; try again later", self.retry_after_s)
                )
                return True
        return False

    def release(self, model: str) -> None:
        self.slots.give_back(model)
        if self.released is not None:
            self.released(model)
        self.wake()

    def wake(self) -> None:
        """Admits waiters, highest class first, while their models have room (also after capacity
        grows); within a class, the tenant with the smallest fair-share counter first, each tenant's
        own in arrival order."""
        for priority in PRIORITY_ORDER:
            queue = self.queues[priority]
            while queue:
                firsts: dict[str, Waiter] = {}
                for waiter in queue:  # each tenant's first waiter whose model has room
                    if waiter.share.tenant not in firsts and self.has_room(waiter.model):
                        firsts[waiter.share.tenant] = waiter
                chosen = min(firsts.values(), key=lambda w: self.fair.counter(w.share.tenant), default=None)
                if chosen is None or not self.slots.try_take(chosen.model, self.capacity(chosen.model)):
                    break
                queue.remove(chosen)
                self.fair.charge(chosen.share.tenant, chosen.share.tokens, chosen.share.weight)
                chosen.admitted.set_result(None)

    def queued(self) -> dict[str, int]:
        return {p: len(q) for p, q in self.queues.items()}
