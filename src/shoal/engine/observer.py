"""Per-request latency events, for metrics and traces. The engine calls an observer from its own thread."""

from __future__ import annotations

from typing import Protocol

from shoal.engine.sequence import Sequence


class RequestObserver(Protocol):
    """Receives each request's latencies as they happen. Times are seconds on the monotonic clock;
    a resumed request's first token is the first one this engine produced for it."""

    def first_token(self, seq: Sequence, time_to_first_token_s: float) -> None: ...

    def next_token(self, seq: Sequence, inter_token_latency_s: float) -> None: ...

    def finished(self, seq: Sequence, e2e_latency_s: float) -> None: ...


class ObserverGroup:
    """Several observers, called in the order given."""

    def __init__(self, *observers: RequestObserver):
        self.observers = observers

    def first_token(self, seq: Sequence, time_to_first_token_s: float) -> None:
        for observer in self.observers:
            observer.first_token(seq, time_to_first_token_s)

    def next_token(self, seq: Sequence, inter_token_latency_s: float) -> None:
        for observer in self.observers:
            observer.next_token(seq, inter_token_latency_s)

    def finished(self, seq: Sequence, e2e_latency_s: float) -> None:
        for observer in self.observers:
            observer.finished(seq, e2e_latency_s)
