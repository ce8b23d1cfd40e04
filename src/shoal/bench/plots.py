"""PNG plots of a run (matplotlib's Agg renderer, no display needed): latency CDFs, and latency over
the run's time."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from shoal.bench.records import RequestRecord


def write_plots(records: Sequence[RequestRecord], directory: Path) -> list[Path]:
    """Writes latency_cdf.png and latency_over_time.png into `directory` (made if missing); returns
    their paths. Latencies are of completed requests; failed ones are marked at the time they started."""
    directory.mkdir(parents=True, exist_ok=True)
    done = [r for r in records if r.ok]
    paths = [directory / "latency_cdf.png", directory / "latency_over_time.png"]

    figure = Figure(figsize=(13, 4), layout="constrained")
    for axes, (name, values) in zip(
        figure.subplots(1, 3),
        (
            ("time to first token", [r.ttft_ms for r in done if r.ttft_ms is not None]),
            ("inter-token latency", [gap for r in done for gap in r.itl_ms]),
            ("end-to-end latency", [r.e2e_ms for r in done]),
        ),
    ):
        _cdf(axes, name, values)
    figure.savefig(paths[0], dpi=100)

    figure = Figure(figsize=(10, 4.5), layout="constrained")
    axes = figure.subplots()
    axes.scatter([r.start_s for r in done], [r.e2e_ms for r in done], s=12, label="end-to-end")
    axes.scatter(
        [r.start_s for r in done if r.ttft_ms is not None],
        [r.ttft_ms for r in done if r.ttft_ms is not None],
        s=12,
        label="time to first token",
    )
    failed = [r.start_s if r.start_s is not None else r.arrival_s for r in records if not r.ok]
    if failed:
        axes.scatter(failed, [0] * len(failed), marker="x", color="red", label=f"failed ({len(failed)})")
    axes.set(title="latency over the run", xlabel="request start (s since the run began)", ylabel="ms")
    axes.grid(alpha=0.3)
    axes.legend()
    figure.savefig(paths[1], dpi=100)
    return paths


def _cdf(axes: Axes, name: str, values: list[float]) -> None:
    """The empirical CDF of `values` (ms), or a note that there are none."""
    axes.set(title=name, xlabel="ms", ylabel="fraction ≤ x", ylim=(0, 1.02))
    axes.grid(alpha=0.3)
    if not values:
        axes.text(0.5, 0.5, "no data", ha="center", va="center", transform=axes.transAxes)
        return
    ordered = sorted(values)
    axes.step(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], where="post")
