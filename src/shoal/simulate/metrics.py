"""What a simulated run measured: one outcome per request, and the run's figures."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from shoal.bench.stats import Distribution


@dataclass(frozen=True)
class RequestOutcome:
    """One request. Times are seconds of simulated time since the start; it failed iff `error`.
    `sent_s` is when the client sent it (after its arrival, its previous turn and the concurrency
    cap), None for a turn never sent because an earlier one failed. `cached_tokens` is what its
    first worker found in the prefix cache (None if it never started); `worker_class` the class of
    the worker that finished it; `met_targets` whether it met its latency targets (None: it had
    none; False where it failed)."""

    index: int
    conversation_id: int
    turn: int
    arrival_s: float
    sent_s: float | None
    first_token_s: float | None
    finished_s: float
    prompt_tokens: int
    cached_tokens: int | None
    completion_tokens: int
    migrations: int
    lost_tokens: int
    recomputed_tokens: int
    worker_class: str | None
    error: str | None
    met_targets: bool | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft_ms(self) -> float | None:
        return None if self.first_token_s is None else (self.first_token_s - self.sent_s) * 1000

    @property
    def e2e_ms(self) -> float | None:
        return None if self.sent_s is None else (self.finished_s - self.sent_s) * 1000


@dataclass(frozen=True)
class SimSummary:
    """A run in figures, defined as `shoal bench` defines them: completed + failed = total;
    throughputs count completed requests over `duration_s` (start to the last request's end);
    latencies are of completed requests (TTFT: sent to first token; ITL: each request's mean gap
    between tokens). cache_hit_rate = prompt tokens found cached / prompt tokens, over requests that
    started. Failures: workers that failed, streams moved (`migrations`), KV tokens lost with them
    and those recomputed, requests failed (`errors` by reason). Of the requests with latency
    targets (`with_targets`), `met_targets` met them; `goodput` is those per second of
    `duration_s` (shed and failed requests count as missed)."""

    total: int
    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    prompt_tokens: int
    cached_tokens: int
    cache_hit_rate: float
    completion_tokens: int
    ttft_ms: Distribution | None
    itl_ms: Distribution | None
    e2e_ms: Distribution | None
    worker_failures: int
    migrations: int
    lost_tokens: int
    recomputed_tokens: int
    completed_by_class: dict[str, int]
    errors: dict[str, int]
    with_targets: int = 0
    met_targets: int = 0
    goodput: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(outcomes: Sequence[RequestOutcome], worker_failures: int) -> SimSummary:
    done = [o for o in outcomes if o.ok]
    started = [o for o in outcomes if o.cached_tokens is not None]
    duration = max((o.finished_s for o in outcomes), default=0.0)
    prompt = sum(o.prompt_tokens for o in started)
    cached = sum(o.cached_tokens for o in started)
    completion = sum(o.completion_tokens for o in done)
    met = sum(1 for o in outcomes if o.met_targets)
    itl = [(o.e2e_ms - o.ttft_ms) / (o.completion_tokens - 1) for o in done if o.completion_tokens > 1]
    return SimSummary(
        total=len(outcomes),
        completed=len(done),
        failed=len(outcomes) - len(done),
        duration_s=duration,
        request_throughput=len(done) / duration if duration else 0.0,
        output_throughput=completion / duration if duration else 0.0,
        prompt_tokens=prompt,
        cached_tokens=cached,
        cache_hit_rate=cached / prompt if prompt else 0.0,
        completion_tokens=completion,
        ttft_ms=Distribution.of([o.ttft_ms for o in done]),
        itl_ms=Distribution.of(itl),
        e2e_ms=Distribution.of([o.e2e_ms for o in done]),
        worker_failures=worker_failures,
        migrations=sum(o.migrations for o in outcomes),
        lost_tokens=sum(o.lost_tokens for o in outcomes),
        recomputed_tokens=sum(o.recomputed_tokens for o in outcomes),
        completed_by_class=dict(sorted(Counter(o.worker_class for o in done).items())),
        errors=dict(Counter(o.error for o in outcomes if not o.ok).most_common()),
        with_targets=sum(1 for o in outcomes if o.met_targets is not None),
        met_targets=met,
        goodput=met / duration if duration else 0.0,
    )
