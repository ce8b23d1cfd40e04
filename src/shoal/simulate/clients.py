"""The clients: the workload sent as `shoal bench`'s runner sends it, in simulated time."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

from shoal.router.placement.latency_targets import met
from shoal.simulate.events import EventLoop
from shoal.simulate.metrics import RequestOutcome
from shoal.simulate.router import Flight, SimRouter
from shoal.simulate.tokens import SimRequest


class Clients:
    """A turn is sent no earlier than its arrival time and after its previous turn's answer, and
    reaches the router `overhead_s` later (the HTTP path, the router's and the worker's front ends,
    tokenization: all that happens outside engine steps); at most `concurrency` requests are in
    flight (None: no cap), the rest wait in order; the turns
    after a failed one are recorded as failed, unsent, at their arrival times. The loop stops once
    every request has an outcome. Invariant: `outcomes` holds one outcome per finished request."""

    def __init__(
        self, requests: Sequence[SimRequest], concurrency: int | None, loop: EventLoop, overhead_s: float = 0.0
    ):
        self.loop = loop
        self.concurrency = concurrency
        self.overhead_s = overhead_s
        self.router: SimRouter | None = None  # set by connect()
        self.outcomes: dict[int, RequestOutcome] = {}
        self.total = len(requests)
        self._next_turn = {(r.conversation_id, r.turn - 1): r for r in requests if r.turn > 0}
        self._first_turns = [r for r in requests if r.turn == 0]
        self._queue: deque[SimRequest] = deque()
        self._in_flight = 0
        self._worker_class: dict[str, str] = {}

    def connect(self, router: SimRouter) -> None:
        self.router = router
        self._worker_class = {worker_id: w.spec.worker_class for worker_id, w in router.workers.items()}
        for request in self._first_turns:
            self.loop.at(request.arrival_s, self._ready, request)

    def _ready(self, request: SimRequest) -> None:
        if self.concurrency is not None and self._in_flight >= self.concurrency:
            self._queue.append(request)
            return
        self._in_flight += 1
        self.loop.after(self.overhead_s, self.router.submit, request, self.loop.now)

    def done(self, flight: Flight, error: str | None) -> None:
        request = flight.request
        worker = flight.placement.worker.worker_id if flight.placement else None
        self._record(
            RequestOutcome(
                request.index,
                request.conversation_id,
                request.turn,
                request.arrival_s,
                flight.sent_s,
                flight.first_token_s,
                self.loop.now,
                request.prompt_tokens,
                flight.cached_tokens,
                0 if error else request.max_tokens,
                flight.migrations,
                flight.lost_tokens,
                flight.recomputed_tokens,
                self._worker_class.get(worker),
                error,
                self._met(flight, error),
            )
        )
        self._in_flight -= 1
        if self._queue:
            self._ready(self._queue.popleft())
        following = self._next_turn.get((request.conversation_id, request.turn))
        if following is not None:
            self.loop.at(
                max(self.loop.now, following.arrival_s), self._ready if error is None else self._not_sent, following
            )

    def _met(self, flight: Flight, error: str | None) -> bool | None:
        """Whether the request met the targets its client sent (None: it sent none)."""
        scored = flight.scored
        if scored.ttft_target_s is None and scored.tpot_target_s is None:
            return None
        if error is not None:
            return False
        tokens = flight.request.max_tokens
        tpot = (self.loop.now - flight.first_token_s) / (tokens - 1) if tokens > 1 else None
        return met(scored, flight.first_token_s - flight.sent_s, tpot)

    def _not_sent(self, request: SimRequest) -> None:
        self._record(
            RequestOutcome(
                request.index,
                request.conversation_id,
                request.turn,
                request.arrival_s,
                None,
                None,
                self.loop.now,
                request.prompt_tokens,
                None,
                0,
                0,
                0,
                0,
                None,
                "not sent: an earlier turn of its conversation failed",
                False if self.router.settings.has_targets else None,
            )
        )
        following = self._next_turn.get((request.conversation_id, request.turn))
        if following is not None:
            self.loop.at(max(self.loop.now, following.arrival_s), self._not_sent, following)

    def _record(self, outcome: RequestOutcome) -> None:
        self.outcomes[outcome.index] = outcome
        if len(self.outcomes) == self.total:
            self.loop.stop()
