"""Statistics of a run's records: latency distributions, throughput and goodput under SLOs."""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from shoal.bench.records import RequestRecord
from shoal.percentile import percentiles


@dataclass(frozen=True)
class Distribution:
    """Of `count` ≥ 1 values: the mean and p50 ≤ p90 ≤ p95 ≤ p99."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Distribution | None:
        """None for no values."""
        if not values:
            return None
        return cls(len(values), sum(values) / len(values), *percentiles(values, (50, 90, 95, 99)))


@dataclass(frozen=True)
class SLO:
    """Latency bounds in ms; None leaves one unchecked. The ITL bound applies to a request's largest
    gap: a stall anywhere in the stream breaks it. A bound on something a request lacks (a first
    content chunk, gaps) holds."""

    ttft_ms: float | None = None
    itl_ms: float | None = None
    e2e_ms: float | None = None

    def met_by(self, record: RequestRecord) -> bool:
        """A failed request meets no SLO; a completed one meets every bound that is given."""
        if not record.ok:
            return False
        checks = ((self.ttft_ms, record.ttft_ms), (self.itl_ms, record.max_itl_ms), (self.e2e_ms, record.e2e_ms))
        return all(bound is None or value is None or value <= bound for bound, value in checks)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Summary:
    """A run in figures. completed + failed = total; throughputs are per second of `duration_s`
    and count completed requests only; goodput ≤ request_throughput; good_fraction = good / total.
    Latencies are over completed requests, ITL over all their gaps. `errors` counts the failures
    by kind, named by an example."""

    total: int
    completed: int
    failed: int
    duration_s: float
    prompt_tokens: int
    completion_tokens: int
    request_throughput: float
    output_throughput: float
    ttft_ms: Distribution | None
    itl_ms: Distribution | None
    e2e_ms: Distribution | None
    slo: SLO
    good: int
    goodput: float
    good_fraction: float
    errors: dict[str, int]

    def as_dict(self) -> dict:
        return asdict(self)


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: SLO = SLO()) -> Summary:
    """Figures of `records` over a run of `duration_s` seconds (no records, or no time, give zeros)."""
    done = [r for r in records if r.ok]
    good = sum(slo.met_by(r) for r in done)
    completion_tokens = sum(r.completion_tokens for r in done)

    def per_second(count: float) -> float:
        return count / duration_s if duration_s > 0 else 0.0

    return Summary(
        total=len(records),
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        prompt_tokens=sum(r.prompt_tokens or 0 for r in done),
        completion_tokens=completion_tokens,
        request_throughput=per_second(len(done)),
        output_throughput=per_second(completion_tokens),
        ttft_ms=Distribution.of([r.ttft_ms for r in done if r.ttft_ms is not None]),
        itl_ms=Distribution.of([gap for r in done for gap in r.itl_ms]),
        e2e_ms=Distribution.of([r.e2e_ms for r in done]),
        slo=slo,
        good=good,
        goodput=per_second(good),
        good_fraction=good / len(records) if records else 0.0,
        errors=_error_counts(records),
    )


def _error_counts(records: Sequence[RequestRecord]) -> dict[str, int]:
    """Failures by kind (the same status and message but for numbers), most frequent first, each
    kind named by its first example."""
    examples: dict[str, str] = {}
    counts: Counter[str] = Counter()
    for record in records:
        if record.ok:
            continue
        status = f"HTTP {record.status}" if record.status is not None else "no response"
        text = f"{status}: {(record.error or '')[:160]}"
        kind = re.sub(r"[0-9]+", "#", text)
        examples.setdefault(kind, text)
        counts[kind] += 1
    return {examples[kind]: count for kind, count in counts.most_common()}
