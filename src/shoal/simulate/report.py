"""A comparison of simulated runs as a table on the terminal, and as JSON."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from shoal.simulate.cost_model import StepCost
from shoal.simulate.router import SHED
from shoal.simulate.simulation import SimulationConfig, SimulationResult


def print_comparison(config: SimulationConfig, results: Sequence[SimulationResult], console: Console) -> None:
    """The fleet and cost model in a line each, then one row per policy."""
    fleet = config.fleet
    classes = ", ".join(f"{count} {name}" for name, count in fleet.counts().items())
    cost = StepCost.from_calibration(config.figures.calibration)
    console.print(f"[bold]fleet[/bold]: {fleet.workers} workers ({classes}); calibration from {config.figures.source}")
    console.print(
        f"[bold]step cost at speed 1[/bold]: max({cost.floor_s * 1e3:.1f} ms, tokens x "
        f"{cost.token_s * 1e3:.2f} ms) + decoding sequences x {cost.seq_s * 1e3:.2f} ms"
    )
    latency = Table(
        title=f"shoal simulate: {config.workload.kind}, {config.workload.requests} requests; latency (ms)",
        title_justify="left",
    )
    for column in ("policy", "done / failed", "TTFT p50", "TTFT p99", "TTFT mean", "E2E p50", "E2E p99"):
        latency.add_column(column, justify="left" if column == "policy" else "right", no_wrap=column == "policy")
    work = Table(title="throughput, prefix cache and failures", title_justify="left")
    for column in ("policy", "output tok/s", "req/s", "cache hit", "failures", "moved", "lost tokens", "simulated"):
        work.add_column(column, justify="left" if column == "policy" else "right", no_wrap=column == "policy")
    for result in results:
        s = result.summary
        ttft, e2e = s.ttft_ms, s.e2e_ms
        latency.add_row(
            result.policy,
            f"{s.completed} / {s.failed}",
            _ms(ttft and ttft.p50),
            _ms(ttft and ttft.p99),
            _ms(ttft and ttft.mean),
            _ms(e2e and e2e.p50),
            _ms(e2e and e2e.p99),
        )
        work.add_row(
            result.policy,
            f"{s.output_throughput:.0f}",
            f"{s.request_throughput:.2f}",
            f"{s.cache_hit_rate:.1%}",
            str(s.worker_failures),
            str(s.migrations),
            str(s.lost_tokens),
            f"{s.duration_s:.0f} s in {result.wall_s:.0f} s",
        )
    console.print(latency)
    console.print(work)
    if config.router.has_targets:
        console.print(_goodput_table(config, results))


def _goodput_table(config: SimulationConfig, results: Sequence[SimulationResult]) -> Table:
    """Per policy: the requests that met their latency targets, those refused at once, goodput."""
    settings = config.router
    targets = ", ".join(
        f"{name} {value:,.0f} ms"
        for name, value in (("TTFT", settings.ttft_target_ms), ("TPOT", settings.tpot_target_ms))
        if value
    )
    told = "" if settings.read_targets else "; the router is not told them"
    table = Table(title=f"latency targets: {targets}{told}", title_justify="left")
    for column in ("policy", "met", "missed", "shed", "goodput req/s"):
        table.add_column(column, justify="left" if column == "policy" else "right", no_wrap=column == "policy")
    for result in results:
        s = result.summary
        shed = s.errors.get(SHED, 0)
        table.add_row(
            result.policy,
            f"{s.met_targets} ({s.met_targets / max(1, s.with_targets):.1%})",
            str(s.with_targets - s.met_targets - shed),
            str(shed),
            f"{s.goodput:.2f}",
        )
    return table


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def write_json(path: Path, config: SimulationConfig, results: Sequence[SimulationResult], outcomes: bool) -> None:
    """{"config" (the policy aside), "step_cost", "results": {policy: {"summary", "events", "wall_s"
    and, with `outcomes`, "requests"}}}: latencies in ms, times in s."""
    path.parent.mkdir(parents=True, exist_ok=True)
    settings = config.as_dict()
    del settings["router"]["policy"]
    body = {
        "config": settings,
        "step_cost": StepCost.from_calibration(config.figures.calibration).as_dict(),
        "results": {},
    }
    for result in results:
        entry = {"summary": result.summary.as_dict(), "events": result.events, "wall_s": result.wall_s}
        if outcomes:
            entry["requests"] = [asdict(o) for o in result.outcomes]
        body["results"][result.policy] = entry
    path.write_text(json.dumps(body, indent=1))
