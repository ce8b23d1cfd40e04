"""Goodput (requests that met their latency targets, per second) with the router's target placement
against llm-d's predicted-latency rule, in the simulator: a fleet of fast and slow workers, prompts
of very different lengths, every request with the same TTFT and TPOT targets and half of them
sheddable, at the arrival rate where `cost` placing without the targets (the router not told
them) misses --miss of them (found by bisection on the first seed). At that rate each seed runs:

- `cost`, not told the targets (no target placement, no shedding);
- `cost` with them (placement where they are predicted met, sheddable work refused at once where
  no worker can meet them);
- `llm_d_latency` with them (llm-d's rule: shoal.router.placement.policies.peer_llm_d_latency, fed
  the same predictions; the same admission sheds);
- `llm_d` (llm-d's default weighted scorers), with the same admission.

Reported per run: the share that met the targets, those shed, goodput, and the ratio of each
goodput to llm_d_latency's in the same seed (the median over seeds).

    .venv/bin/python benchmarks/goodput.py [--workers 16] [--requests 3000] [--seeds 1,2,3] [--jobs 2]

The simulation is deterministic: the machine's speed moves only how long it takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from cpu_name import cpu_description

from shoal.simulate.options import add_simulate_arguments, simulation_config
from shoal.simulate.router import SHED
from shoal.simulate.simulation import simulate

RESULTS = Path(__file__).parent / "results"
RUNS = (("cost", False), ("cost", True), ("llm_d_latency", True), ("llm_d", True))


def fleet_args(args: argparse.Namespace, rate: float, seed: int) -> list[str]:
    return [
        "--workers", str(args.workers), "--mix", args.mix, "--workload", "long-prompt",
        "--requests", str(args.requests), "--prompt-tokens", "64:768", "--output-tokens", "32:192",
        "--long-fraction", "0.1", "--long-prompt-tokens", "2000:4000",
        "--ttft-target-ms", str(args.ttft_target_ms), "--tpot-target-ms", str(args.tpot_target_ms),
        "--sheddable-share", str(args.sheddable_share), "--rate", str(rate), "--seed", str(seed),
    ]  # fmt: skip


def run(args: argparse.Namespace, rate: float, seed: int, policy: str, told: bool) -> dict:
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    config = simulation_config(parser.parse_args(fleet_args(args, rate, seed)), policy)
    config = dataclasses.replace(config, router=dataclasses.replace(config.router, read_targets=told))
    summary = simulate(config).summary
    shed = summary.errors.get(SHED, 0)
    return {
        "policy": policy if told else f"{policy} (not told the targets)",
        "seed": seed,
        "rate": rate,
        "met_share": summary.met_targets / summary.with_targets,
        "missed_share": 1 - summary.met_targets / summary.with_targets,
        "shed": shed,
        "goodput": summary.goodput,
        "ttft_p99_ms": summary.ttft_ms.p99 if summary.ttft_ms else None,
        "duration_s": summary.duration_s,
    }


def rate_for_miss(args: argparse.Namespace, seed: int) -> float:
    """The arrival rate at which cost, not told the targets, misses about args.miss of them."""
    low, high = args.rate_low, args.rate_high
    for _ in range(args.bisections):
        middle = (low + high) / 2
        missed = run(args, middle, seed, "cost", False)["missed_share"]
        print(f"  rate {middle:.2f}/s: cost alone misses {missed:.1%}", flush=True)
        if abs(missed - args.miss) < 0.01:
            return middle
        low, high = (middle, high) if missed < args.miss else (low, middle)
    return (low + high) / 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=16)
    parser.add_argument("--mix", default="fast:0.25:speed=2;slow:0.75:speed=1")
    parser.add_argument("--requests", type=int, default=3000)
    parser.add_argument("--ttft-target-ms", type=float, default=1500)
    parser.add_argument("--tpot-target-ms", type=float, default=120)
    parser.add_argument("--sheddable-share", type=float, default=0.5)
    parser.add_argument("--miss", type=float, default=0.2, help="share cost alone misses at the chosen rate")
    parser.add_argument("--rate-low", type=float, default=2.0)
    parser.add_argument("--rate-high", type=float, default=40.0)
    parser.add_argument("--bisections", type=int, default=8)
    parser.add_argument("--seeds", default="1,2,3")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    started = time.time()
    rate = rate_for_miss(args, seeds[0])
    with ProcessPoolExecutor(args.jobs) as pool:
        futures = [pool.submit(run, args, rate, seed, policy, told) for seed in seeds for policy, told in RUNS]
        rows = [f.result() for f in futures]
    reference = {r["seed"]: r["goodput"] for r in rows if r["policy"] == "llm_d_latency"}
    for row in rows:
        row["vs_llm_d_latency"] = row["goodput"] / reference[row["seed"]]
    print(f"CPU: {cpu_description()}; {time.time() - started:.0f} s; rate {rate:.2f} requests/s")
    print("| policy | met (median of seeds) | shed | goodput req/s | vs llm_d_latency (by seed) |")
    print("|---|--:|--:|--:|--|")
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == policy]
        ratios = ", ".join(f"{r['vs_llm_d_latency']:.2f}" for r in mine)
        print(
            f"| {policy} | {statistics.median(r['met_share'] for r in mine):.1%} | "
            f"{statistics.median(r['shed'] for r in mine):.0f} | "
            f"{statistics.median(r['goodput'] for r in mine):.2f} | "
            f"**{statistics.median(r['vs_llm_d_latency'] for r in mine):.2f}x** ({ratios}) |"
        )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"goodput-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps({"args": vars(args), "cpu": cpu_description(), "rate": rate, "runs": rows}, indent=1))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
