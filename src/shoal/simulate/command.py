"""`shoal simulate`: runs the workload over the simulated fleet once per policy, prints the
comparison and writes the JSON report and plot. Exit status: 0 when the runs finished (requests
may have failed: that is a result), 2 for bad options or an unreadable calibration source."""

from __future__ import annotations

import argparse
import sys
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from rich.console import Console

from shoal.simulate.options import policies, simulation_config
from shoal.simulate.report import print_comparison, write_json
from shoal.simulate.simulation import SimulationResult, simulate, workload_requests


def run(args: argparse.Namespace) -> int:
    try:
        names = policies(args)
        if args.jobs < 1:
            raise ValueError("--jobs must be at least 1")
        config = simulation_config(args, names[0])
    except Exception as exc:  # bad options, unreadable files, an unreachable worker: all say why
        print(f"shoal simulate: {exc}", file=sys.stderr)
        return 2
    console = Console(stderr=True)
    console.print(f"simulating {len(names)} policies over {config.fleet.workers} workers ...")
    configs = [config.with_policy(name) for name in names]
    if args.jobs > 1 and len(configs) > 1:
        with ProcessPoolExecutor(min(args.jobs, len(configs))) as pool:
            futures = [pool.submit(simulate, c) for c in configs]
            for future in as_completed(futures):
                _report_progress(future.result(), console)
            results = [future.result() for future in futures]
    else:
        requests = workload_requests(config)
        results = [_report_progress(simulate(c, requests), console) for c in configs]
    if args.output_json:
        write_json(Path(args.output_json), config, results, outcomes=not args.summary_only)
    if args.plot:
        from shoal.simulate.plots import write_plot  # matplotlib loads only when a plot is asked for

        write_plot(Path(args.plot), config, results)
    print_comparison(config, results, Console(width=None if sys.stdout.isatty() else 160))
    return 0


def _report_progress(result: SimulationResult, console: Console) -> SimulationResult:
    console.print(f"  {result.policy}: {result.summary.duration_s:.0f} s simulated in {result.wall_s:.1f} s")
    return result
