"""How many requests a server that reports no load serves at once, and how long one takes, as the
router sees them on the requests it relays.

Such a server (llama-cpp-python's, for one) may serve one request at a time and queue the rest
behind a lock, or batch many. The streams past their first token and not finished are the ones it
is serving now (llama-cpp-python answers every request's headers at once and queues behind them),
and the most seen at once is what it has shown it can serve together. That is a lower bound: a
batching server shows more as soon as it is given more, so it is not starved by being taken for a
serial one, and a serial one never shows more than one. Non-streamed requests show nothing.

A request is served from when it was sent or, if later, when the server's previous request ended
(a serial server takes the next one then): exact for a serial server, short for a batching one,
which is only charged it once its requests outnumber what it has shown it serves at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.router.fleet.latency_stats import ALPHA


@dataclass
class ServedConcurrency:
    """Invariants: `serving` counts the streams past their first token and not ended; `most` is at
    least 1 and at least every value `serving` has had; `service_s` is None exactly while no
    request has ended, else the moving mean of their service times; `last_end` is when the latest
    one ended (monotonic seconds, 0 before any)."""

    serving: int = 0
    most: int = 1
    service_s: float | None = None
    last_end: float = 0.0

    def started(self) -> None:
        """A stream's first token arrived."""
        self.serving += 1
        self.most = max(self.most, self.serving)

    def ended(self, sent_at: float, now: float) -> None:
        """A stream past its first token ended; it was sent at `sent_at`."""
        self.serving -= 1
        served_s = now - max(sent_at, self.last_end)
        self.last_end = now
        self.service_s = served_s if self.service_s is None else self.service_s + ALPHA * (served_s - self.service_s)
