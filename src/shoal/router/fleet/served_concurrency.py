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

Its prefill speed is measured the same way: the prompt tokens the router expected it to compute
for a request (what it was not believed to hold) over the time from when it was served to its first
token. With its gap between tokens (shoal.router.fleet.latency_stats) these are the speeds the
router's cost model prices it at, in place of the fleet's.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.router.fleet.latency_stats import ALPHA


@dataclass
class ServedConcurrency:
    """Invariants: `serving` counts the streams past their first token and not ended; `most` is at
    least 1 and at least every value `serving` has had; `service_s` is None exactly while no
    request has ended, else the moving mean of their service times; `last_end` is when the latest
    one ended (monotonic seconds, 0 before any); `prefill_tokens_per_s` is None exactly while no
    stream with a prompt to compute has started, else the moving mean of the rates measured."""

    serving: int = 0
    most: int = 1
    service_s: float | None = None
    last_end: float = 0.0
    prefill_tokens_per_s: float | None = None

    def started(self, sent_at: float, computed_tokens: int, now: float) -> None:
        """A stream's first token arrived; it was sent at `sent_at` with `computed_tokens` of its
        prompt expected to be computed there."""
        self.serving += 1
        self.most = max(self.most, self.serving)
        waited_s = now - max(sent_at, self.last_end)
        if computed_tokens > 0 and waited_s > 0:
            rate = computed_tokens / waited_s
            mean = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = rate if mean is None else mean + ALPHA * (rate - mean)

    def ended(self, sent_at: float, now: float) -> None:
        """A stream past its first token ended; it was sent at `sent_at`."""
        self.serving -= 1
        served_s = now - max(sent_at, self.last_end)
        self.last_end = now
        self.service_s = served_s if self.service_s is None else self.service_s + ALPHA * (served_s - self.service_s)
