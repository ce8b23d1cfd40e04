"""A run's summary as a table on the terminal, and the whole run as JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from shoal.bench.records import RequestRecord
from shoal.bench.stats import Distribution, Summary


def print_summary(summary: Summary, console: Console) -> None:
    """Counts and throughput, then latency percentiles, then the errors (if any)."""
    overview = Table(title="shoal bench", show_header=False, title_justify="left")
    overview.add_column(style="bold")
    overview.add_column(justify="right")
    for name, value in (
        ("requests (completed / failed / total)", f"{summary.completed} / {summary.failed} / {summary.total}"),
        ("duration", f"{summary.duration_s:.2f} s"),
        ("request throughput", f"{summary.request_throughput:.2f} req/s"),
        ("output token throughput", f"{summary.output_throughput:.1f} tok/s"),
        ("prompt / completion tokens", f"{summary.prompt_tokens} / {summary.completion_tokens}"),
        (f"goodput ({_slo_text(summary)})", f"{summary.goodput:.2f} req/s ({summary.good_fraction:.1%} of requests)"),
    ):
        overview.add_row(name, value)
    console.print(overview)

    latency = Table(title="latency (ms)", title_justify="left")
    latency.add_column("metric", style="bold")
    for column in ("count", "mean", "p50", "p90", "p95", "p99"):
        latency.add_column(column, justify="right")
    for name, distribution in (("TTFT", summary.ttft_ms), ("ITL", summary.itl_ms), ("E2E", summary.e2e_ms)):
        latency.add_row(name, *_cells(distribution))
    console.print(latency)

    if summary.errors:
        errors = Table(title="errors", title_justify="left")
        errors.add_column("count", justify="right")
        errors.add_column("error")
        for error, count in summary.errors.items():
            errors.add_row(str(count), error)
        console.print(errors)


def _cells(distribution: Distribution | None) -> list[str]:
    if distribution is None:
        return ["0"] + ["-"] * 5
    figures = (distribution.mean, distribution.p50, distribution.p90, distribution.p95, distribution.p99)
    return [str(distribution.count), *(f"{value:.1f}" for value in figures)]


def _slo_text(summary: Summary) -> str:
    bounds = [
        f"{name} ≤ {value:g} ms"
        for name, value in (("TTFT", summary.slo.ttft_ms), ("max ITL", summary.slo.itl_ms), ("E2E", summary.slo.e2e_ms))
        if value is not None
    ]
    return ", ".join(bounds) or "no SLO"


def write_json(path: Path, config: dict, summary: Summary, records: Sequence[RequestRecord]) -> None:
    """{"config", "summary", "requests": one record each}, latencies in ms and times in s."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        json.dumps(
            {"config": config, "summary": summary.as_dict(), "requests": [record.as_dict() for record in records]},
            indent=2,
        )
    )
