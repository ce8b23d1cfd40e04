"""A PNG comparing policies (matplotlib's Agg renderer, no display needed)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from shoal.simulate.simulation import SimulationConfig, SimulationResult


def write_plot(path: Path, config: SimulationConfig, results: Sequence[SimulationResult]) -> Path:
    """Four panels: the TTFT CDF of each policy, TTFT p50 and p99, output throughput and prefix
    cache hit rate per policy."""
    path.parent.mkdir(parents=True, exist_ok=True)
    names = [r.policy for r in results]
    figure = Figure(figsize=(13, 8.5), layout="constrained")
    classes = ", ".join(f"{count} {name}" for name, count in config.fleet.counts().items())
    figure.suptitle(
        f"{config.fleet.workers} simulated workers ({classes}); {config.workload.requests} "
        f"{config.workload.kind} requests"
    )
    (cdf, ttft), (throughput, hits) = figure.subplots(2, 2)

    for result in results:
        values = sorted(o.ttft_ms for o in result.outcomes if o.ok)
        if values:
            cdf.step(values, [(i + 1) / len(values) for i in range(len(values))], where="post", label=result.policy)
    cdf.set(
        title="time to first token (CDF)", xlabel="ms (log scale)", ylabel="fraction ≤ x", xscale="log", ylim=(0, 1.02)
    )
    cdf.grid(alpha=0.3)
    cdf.legend()

    positions = range(len(names))
    width = 0.4
    ttft.bar([p - width / 2 for p in positions], [_get(r, "p50") for r in results], width, label="p50")
    ttft.bar([p + width / 2 for p in positions], [_get(r, "p99") for r in results], width, label="p99")
    ttft.set(title="time to first token", ylabel="ms", yscale="log")
    ttft.legend()
    throughput.bar(positions, [r.summary.output_throughput for r in results], color="tab:green")
    throughput.set(title="output throughput", ylabel="tokens/s")
    hits.bar(positions, [100 * r.summary.cache_hit_rate for r in results], color="tab:purple")
    hits.set(title="prefix cache hit rate (prompt tokens)", ylabel="%", ylim=(0, 100))
    for axes in (ttft, throughput, hits):
        axes.set_xticks(list(positions), names, rotation=20, ha="right")
        axes.grid(alpha=0.3, axis="y")
    figure.savefig(path, dpi=100)
    return path


def _get(result: SimulationResult, percentile: str) -> float:
    distribution = result.summary.ttft_ms
    return getattr(distribution, percentile) if distribution else 0.0
