"""The router's prefix index from KV events against its guessed one, in the simulator at 100 and
1,000 workers: each fleet under KV pressure (caches that hold a few conversations), a multi-turn
workload over many system prompts, behind one router and behind several independent routers (each
knows only what it placed, as behind a plain load balancer), with the router guessing what each
worker caches, or following its KV events read every 50 ms or every 500 ms. Reported per run: the
workers' prefix-cache hit rate, time to first token p50 and p99, and the ratio of each event run's
hit rate to the guessed run's with the same routers.

    .venv/bin/python benchmarks/kv_event_index.py [--workers 100,1000] [--routers 1,4] [--lags-ms 50,500] [--jobs 2]

Every run of one fleet takes the same workload (same seed); the simulation is deterministic, so
the machine's speed moves only how long it takes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from cpu_name import cpu_description

from shoal.simulate.options import add_simulate_arguments, simulation_config
from shoal.simulate.simulation import simulate, workload_requests

RESULTS = Path(__file__).parent / "results"
# Per 20 workers: 3 requests/s of 4-turn conversations over 40 system prompts of 800 tokens, on
# caches of 3,000 tokens (a conversation's last turn is about 1,800).
RATE_PER_20 = 3.0


def fleet_args(workers: int, requests_per_worker: int, seed: int) -> list[str]:
    return [
        "--workers", str(workers), "--mix", "w:1:kv=3000", "--workload", "multi-turn",
        "--requests", str(workers * requests_per_worker), "--turns", "4",
        "--system-prompt-tokens", "800", "--system-prompts", str(2 * workers),
        "--prompt-tokens", "64:256", "--output-tokens", "32:128",
        "--rate", str(RATE_PER_20 * workers / 20), "--seed", str(seed),
    ]  # fmt: skip


def run(workers: int, routers: int, lag: float | None, requests_per_worker: int, seed: int) -> dict:
    parser = argparse.ArgumentParser()
    add_simulate_arguments(parser)
    args = parser.parse_args(fleet_args(workers, requests_per_worker, seed))
    config = simulation_config(args, "cost")
    router = dataclasses.replace(config.router, routers=routers, kv_event_lag_s=lag)
    result = simulate(dataclasses.replace(config, router=router), workload_requests(config))
    summary = result.summary
    return {
        "workers": workers,
        "routers": routers,
        "index": "guessed" if lag is None else f"events every {lag * 1000:.0f} ms",
        "hit_rate": summary.cache_hit_rate,
        "ttft_p50_ms": summary.ttft_ms.p50,
        "ttft_p99_ms": summary.ttft_ms.p99,
        "completed": summary.completed,
        "wall_s": result.wall_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="100,1000")
    parser.add_argument("--routers", default="1,4")
    parser.add_argument("--requests-per-worker", type=int, default=100)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--lags-ms", default="50,500", help="event lags to run beside the guessed index")
    args = parser.parse_args()
    cases = [
        (int(w), int(r), lag, args.requests_per_worker, args.seed)
        for w in args.workers.split(",")
        for r in args.routers.split(",")
        for lag in (None, *(float(ms) / 1000 for ms in args.lags_ms.split(",")))
    ]
    started = time.time()
    with ProcessPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(run, *zip(*cases)))
    guessed = {(r["workers"], r["routers"]): r["hit_rate"] for r in rows if r["index"] == "guessed"}
    print(f"CPU: {cpu_description()}; {time.time() - started:.0f} s")
    print("| workers | routers | prefix index | cache hit | vs guessed | TTFT p50 | TTFT p99 |")
    print("|--:|--:|---|--:|--:|--:|--:|")
    for r in rows:
        ratio = r["hit_rate"] / guessed[(r["workers"], r["routers"])]
        print(
            f"| {r['workers']:,} | {r['routers']} | {r['index']} | {r['hit_rate']:.1%} | {ratio:.2f}x "
            f"| {r['ttft_p50_ms']:,.0f} ms | {r['ttft_p99_ms']:,.0f} ms |"
        )
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    out = RESULTS / f"kv-event-index-{stamp}.json"
    out.write_text(json.dumps({"cpu": cpu_description(), "args": vars(args), "runs": rows}, indent=1))
    print(f"written: {out}")


if __name__ == "__main__":
    main()
