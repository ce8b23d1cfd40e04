"""`shoal bench` options, and the configs they make. Imports nothing heavy: every `shoal` command
builds this parser."""

from __future__ import annotations

import argparse
import os

from shoal.bench.arrivals import ArrivalProcess
from shoal.bench.lengths import LengthDistribution, parse_length
from shoal.bench.stats import SLO
from shoal.bench.workloads import MULTI_TURN_SYSTEM_PROMPT_TOKENS, WorkloadConfig

LENGTH_HELP = "N (fixed), LO:HI (uniform) or MEAN~STD (normal)"


def length(text: str) -> LengthDistribution:
    try:
        return parse_length(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text} is not above 0")
    return value


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    server = parser.add_argument_group("server")
    server.add_argument("--url", default="http://127.0.0.1:8000", help="server root (default %(default)s)")
    server.add_argument("--model", default=None, help="model to ask for (default: the first at /v1/models)")
    server.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get("OPENAI_API_KEY"),
        help="bearer token (default: $OPENAI_API_KEY); never written to reports",
    )
    server.add_argument(
        "--timeout-s", type=positive, metavar="S", default=600.0, help="per request (default %(default)s)"
    )

    workload = add_workload_arguments(parser)
    workload.add_argument(
        "--ignore-eos",
        action="store_true",
        help="ask the server to generate max_tokens regardless of EOS (a vLLM extension)",
    )
    workload.add_argument("--temperature", type=float, default=0.0)
    add_load_arguments(parser)

    slo = parser.add_argument_group("goodput: a request counts if it meets every SLO given")
    slo.add_argument("--slo-ttft-ms", type=float, metavar="MS", default=None, help="time to first token")
    slo.add_argument(
        "--slo-itl-ms", type=float, metavar="MS", default=None, help="the request's largest inter-token gap"
    )
    slo.add_argument("--slo-e2e-ms", type=float, metavar="MS", default=None, help="end-to-end latency")

    output = parser.add_argument_group("output")
    output.add_argument(
        "--output-json",
        default=None,
        metavar="PATH",
        help="write the config, the summary and every request's record here",
    )
    output.add_argument("--plot-dir", default=None, metavar="DIR", help="write PNG plots here")


def add_workload_arguments(parser: argparse.ArgumentParser) -> argparse._ArgumentGroup:
    """What to send (`workload_config` reads them); returns the group for more options."""
    workload = parser.add_argument_group("workload")
    workload.add_argument("--workload", choices=["synthetic", "multi-turn", "long-prompt"], default="synthetic")
    workload.add_argument(
        "--requests", type=int, metavar="N", default=100, help="requests in all (default %(default)s)"
    )
    workload.add_argument(
        "--prompt-tokens",
        type=length,
        metavar="LEN",
        default=length("256"),
        help=f"each new user message's length: {LENGTH_HELP} (default 256)",
    )
    workload.add_argument(
        "--output-tokens",
        type=length,
        metavar="LEN",
        default=length("128"),
        help=f"max_tokens of each request: {LENGTH_HELP} (default 128)",
    )
    workload.add_argument(
        "--system-prompt-tokens",
        type=int,
        metavar="N",
        default=None,
        help=f"a system prompt shared by all requests (default: {MULTI_TURN_SYSTEM_PROMPT_TOKENS} "
        "for multi-turn, else none)",
    )
    workload.add_argument(
        "--system-prompts",
        type=int,
        metavar="N",
        default=1,
        help="distinct system prompts of that length, conversation i taking number i mod N (multi-turn; default 1)",
    )
    workload.add_argument("--turns", type=int, metavar="N", default=3, help="turns per conversation (multi-turn)")
    workload.add_argument(
        "--long-fraction",
        type=float,
        metavar="F",
        default=0.1,
        help="fraction of requests with long prompts (long-prompt; default %(default)s)",
    )
    workload.add_argument(
        "--long-prompt-tokens",
        type=length,
        metavar="LEN",
        default=length("2048"),
        help=f"long prompts' length: {LENGTH_HELP} (default 2048)",
    )
    workload.add_argument("--seed", type=int, default=0, help="the same seed gives the same requests")
    return workload


def add_load_arguments(parser: argparse.ArgumentParser) -> None:
    """When requests start (`arrival_process` reads them)."""
    load = parser.add_argument_group("load (default: one request at a time)")
    rates = load.add_mutually_exclusive_group()
    rates.add_argument("--rate", type=float, metavar="R", help="Poisson arrivals at R requests/s")
    rates.add_argument("--fixed-rate", type=float, metavar="R", help="evenly spaced arrivals at R requests/s")
    load.add_argument(
        "--concurrency",
        type=int,
        metavar="N",
        default=None,
        help="requests in flight: alone, a closed loop; with a rate, a cap",
    )


def workload_config(args: argparse.Namespace) -> WorkloadConfig:
    """Raises ValueError for values out of range."""
    system_tokens = args.system_prompt_tokens
    if system_tokens is None:
        system_tokens = MULTI_TURN_SYSTEM_PROMPT_TOKENS if args.workload == "multi-turn" else 0
    return WorkloadConfig(
        kind=args.workload,
        requests=args.requests,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        system_prompt_tokens=system_tokens,
        system_prompts=args.system_prompts,
        turns=args.turns,
        long_fraction=args.long_fraction,
        long_prompt_tokens=args.long_prompt_tokens,
        seed=args.seed,
    )


def arrival_process(args: argparse.Namespace) -> ArrivalProcess:
    """Raises ValueError for values out of range."""
    if args.rate is not None:
        return ArrivalProcess("poisson", args.rate, args.concurrency)
    if args.fixed_rate is not None:
        return ArrivalProcess("fixed", args.fixed_rate, args.concurrency)
    return ArrivalProcess("closed", concurrency=args.concurrency or 1)


def slo(args: argparse.Namespace) -> SLO:
    return SLO(ttft_ms=args.slo_ttft_ms, itl_ms=args.slo_itl_ms, e2e_ms=args.slo_e2e_ms)
