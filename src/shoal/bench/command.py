"""`shoal bench`: runs a workload against a server with a progress bar, prints the summary and
writes the JSON report and plots. Exit status: 0 when every request completed, 1 when any failed
(the report is still written) or the model could not be found, 2 for bad options."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path

import aiohttp
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from shoal.bench.client import ChatClient, ClientSettings, first_model
from shoal.bench.options import arrival_process, slo, workload_config
from shoal.bench.records import RequestRecord
from shoal.bench.report import print_summary, write_json
from shoal.bench.runner import RunResult, run_workload
from shoal.bench.stats import summarize
from shoal.bench.workloads import BenchRequest, build_workload


class ModelUnknown(Exception):
    """No --model was given and the server did not name one."""


def run(args: argparse.Namespace) -> int:
    try:
        workload, arrivals = workload_config(args), arrival_process(args)
    except ValueError as exc:
        print(f"shoal bench: {exc}", file=sys.stderr)
        return 2
    requests = build_workload(workload, arrivals)
    try:
        settings, result = asyncio.run(_run(args, requests, arrivals.concurrency))
    except ModelUnknown as exc:
        print(f"shoal bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("shoal bench: interrupted", file=sys.stderr)
        return 130
    bounds = slo(args)
    summary = summarize(result.records, result.duration_s, bounds)
    if args.output_json:
        config = {
            "client": settings.as_dict(),
            "workload": workload.as_dict(),
            "arrivals": asdict(arrivals),
            "slo": bounds.as_dict(),
        }
        write_json(Path(args.output_json), config, summary, result.records)
    if args.plot_dir:
        from shoal.bench.plots import write_plots  # matplotlib loads only when plots are asked for

        write_plots(result.records, Path(args.plot_dir))
    print_summary(summary, Console())
    return 0 if summary.failed == 0 else 1


async def _run(
    args: argparse.Namespace, requests: Sequence[BenchRequest], concurrency: int | None
) -> tuple[ClientSettings, RunResult]:
    # No connection limit: the arrival process and --concurrency alone decide what is in flight.
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        model = args.model
        if model is None:
            try:
                model = await first_model(session, args.url, args.api_key)
            except Exception as exc:  # unreachable, refused, not OpenAI-compatible: no model either way
                raise ModelUnknown(
                    f"cannot list the models at {args.url} ({type(exc).__name__}: {exc}); "
                    "is the server up? --model names the model without asking"
                ) from None
        settings = ClientSettings(
            url=args.url,
            model=model,
            api_key=args.api_key,
            temperature=args.temperature,
            ignore_eos=args.ignore_eos,
            timeout_s=args.timeout_s,
        )
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=Console(stderr=True),
        ) as progress:
            task = progress.add_task(f"{model} @ {args.url}", total=len(requests))
            failed = 0

            def advance(record: RequestRecord) -> None:
                nonlocal failed
                failed += not record.ok
                progress.update(task, advance=1, description=f"{model} @ {args.url}  failed: {failed}")

            result = await run_workload(requests, ChatClient(session, settings), concurrency, advance)
    return settings, result
