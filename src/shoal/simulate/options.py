"""`shoal simulate` options, and the config they make. Imports nothing heavy: every `shoal` command
builds this parser."""

from __future__ import annotations

import argparse
from pathlib import Path

from shoal.bench.options import add_load_arguments, add_workload_arguments, arrival_process, workload_config

DEFAULT_POLICIES = "round_robin,least_outstanding_tokens,power_of_two,cache_aware,cost"


def add_simulate_arguments(parser: argparse.ArgumentParser) -> None:
    fleet = parser.add_argument_group("fleet")
    fleet.add_argument(
        "--workers",
        type=int,
        metavar="N",
        default=None,
        help="workers in the fleet (default: the --fleet file's count, else 10)",
    )
    fleet.add_argument(
        "--mix",
        metavar="SPEC",
        default=None,
        help='worker classes, e.g. "fast:0.2:speed=4,kv=200000;slow:0.8:kv=50000" (keys: speed '
        "kv seqs max_len batch_tokens mtbf repair threads per_host cores)",
    )
    fleet.add_argument("--fleet", metavar="YAML", default=None, help="workers and classes from a file instead")
    fleet.add_argument(
        "--calibrate-from",
        metavar="URL|JSON",
        action="append",
        default=[],
        help="a shoal worker (http://host:port: the speeds its /load reports now) or a JSON file "
        "with its /load report or calibration; repeat to average several (default: a "
        "SmolLM2-135M worker on one CPU core)",
    )

    router = parser.add_argument_group("router")
    router.add_argument(
        "--policies", default=DEFAULT_POLICIES, help="comma-separated policies to compare (default %(default)s)"
    )
    router.add_argument(
        "--report-interval-s",
        type=float,
        metavar="S",
        default=0.5,
        help="how often each worker's load report reaches the router (default %(default)s)",
    )
    router.add_argument(
        "--max-migrations",
        type=int,
        metavar="N",
        default=3,
        help="moves of one stream before it fails (default %(default)s)",
    )
    router.add_argument(
        "--kv-event-lag-ms",
        type=float,
        metavar="MS",
        default=None,
        help="workers publish KV events and the router reads each one's every MS (default: the router "
        "guesses what each worker caches)",
    )
    router.add_argument(
        "--routers",
        type=int,
        metavar="N",
        default=1,
        help="independent routers taking the requests in turn, each knowing only what it placed (default 1)",
    )
    router.add_argument("--ttft-target-ms", type=float, metavar="MS", default=None, help="every request's TTFT target")
    router.add_argument("--tpot-target-ms", type=float, metavar="MS", default=None, help="every request's TPOT target")
    router.add_argument(
        "--sheddable-share",
        type=float,
        metavar="F",
        default=0.0,
        help="share of the requests sent as sheddable: refused at once where no worker is predicted to meet "
        "their targets (default 0)",
    )
    router.add_argument(
        "--ignore-targets",
        action="store_true",
        help="the router is not told the targets (no target placement or shedding); they still score goodput",
    )
    router.add_argument(
        "--request-overhead-ms",
        type=float,
        metavar="MS",
        default=0.0,
        help="from a client's send to the router: HTTP, front ends, tokenization (default 0)",
    )

    add_workload_arguments(parser)
    add_load_arguments(parser)

    output = parser.add_argument_group("output")
    output.add_argument(
        "--output-json",
        metavar="PATH",
        default=None,
        help="write the config, each policy's summary and every request's outcome here",
    )
    output.add_argument("--plot", metavar="PNG", default=None, help="write a comparison plot here")
    output.add_argument("--summary-only", action="store_true", help="leave the per-request outcomes out of the JSON")
    output.add_argument(
        "--jobs",
        type=int,
        metavar="N",
        default=1,
        help="simulate up to N policies at once, in separate processes (default 1)",
    )


def simulation_config(args: argparse.Namespace, policy: str):
    """The run's config with `policy`; raises ValueError (or OSError, or an HTTP error for
    --calibrate-from) with the reason."""
    from shoal.simulate.calibration import DEFAULT_FIGURES, average, read_figures
    from shoal.simulate.fleet import FleetSpec, load_fleet, parse_mix
    from shoal.simulate.router import RouterSettings
    from shoal.simulate.simulation import SimulationConfig

    if args.fleet and args.mix:
        raise ValueError("give either --fleet or --mix, not both")
    if args.fleet:
        fleet = load_fleet(Path(args.fleet), args.workers)
    else:
        workers = 10 if args.workers is None else args.workers
        fleet = FleetSpec(workers, parse_mix(args.mix)) if args.mix else FleetSpec(workers)
    figures = (
        average([read_figures(source) for source in args.calibrate_from]) if args.calibrate_from else DEFAULT_FIGURES
    )
    if args.report_interval_s <= 0 or args.max_migrations < 0 or args.request_overhead_ms < 0:
        raise ValueError("--report-interval-s must be above 0, --max-migrations and --request-overhead-ms at least 0")
    if args.kv_event_lag_ms is not None and args.kv_event_lag_ms <= 0:
        raise ValueError("--kv-event-lag-ms must be above 0")
    if args.routers < 1:
        raise ValueError("--routers must be at least 1")
    if any(t is not None and t <= 0 for t in (args.ttft_target_ms, args.tpot_target_ms)):
        raise ValueError("--ttft-target-ms and --tpot-target-ms must be above 0")
    if not 0 <= args.sheddable_share <= 1:
        raise ValueError("--sheddable-share must be from 0 to 1")
    lag = args.kv_event_lag_ms / 1000 if args.kv_event_lag_ms is not None else None
    router = RouterSettings(
        policy=policy,
        report_interval_s=args.report_interval_s,
        max_migrations=args.max_migrations,
        kv_event_lag_s=lag,
        routers=args.routers,
        ttft_target_ms=args.ttft_target_ms,
        tpot_target_ms=args.tpot_target_ms,
        sheddable_share=args.sheddable_share,
        read_targets=not args.ignore_targets,
    )
    return SimulationConfig(
        fleet, workload_config(args), arrival_process(args), router, figures, args.seed, args.request_overhead_ms / 1000
    )


def policies(args: argparse.Namespace) -> list[str]:
    """The policies asked for, checked against the router's; ValueError names the unknown ones."""
    from shoal.router.placement.policies import POLICIES

    names = [name.strip() for name in args.policies.split(",") if name.strip()]
    unknown = [name for name in names if name not in POLICIES]
    if unknown or not names:
        raise ValueError(f"unknown policies {unknown}; choose from {sorted(POLICIES)}")
    return names
