"""Warm start: how soon a restarted SmolLM2 worker is ready, and what several workers on one host
cost in memory against one.

Restart-to-ready: `shoal worker` is started with its weight cache and calibration already on disk
(a first start fills them and is reported apart, as "cold"), and the time until /ready answers 200
is measured, --runs times. Memory: N workers start together, and once all are ready their
proportional set size (PSS: a page shared by k processes counts 1/k to each) is summed and compared
with one worker's, so memory-mapped weights that the workers share count once.

    .venv/bin/python benchmarks/warm_start.py [--runs 5] [--workers 4] [--kv-cache 256MiB] [--share-weights]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
from routing_quality import RESULTS, free_port

MODEL = "smollm2-135m-instruct"


def start_worker(args, cache_dir: Path, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "shoal.cli",
        "worker",
        "--model",
        MODEL,
        "--port",
        str(port),
        "--kv-cache",
        args.kv_cache,
        "--num-threads",
        str(args.threads),
    ]
    if args.share_weights:
        command.append("--share-weights")
    with open(log, "ab") as out:
        process = subprocess.Popen(
            command, env={**os.environ, "SHOAL_CACHE_DIR": str(cache_dir)}, stdout=out, stderr=subprocess.STDOUT
        )
    return process, f"http://127.0.0.1:{port}"


def until_ready(process: subprocess.Popen, url: str, started: float) -> float:
    while process.poll() is None:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.02)
    raise RuntimeError(f"worker exited with {process.returncode}")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    process.wait(timeout=60)


def restart_to_ready(args, cache_dir: Path, log: Path) -> float:
    started = time.monotonic()
    process, url = start_worker(args, cache_dir, log)
    try:
        return until_ready(process, url, started)
    finally:
        stop(process)


def pss_of(processes: list[subprocess.Popen]) -> int:
    return sum(psutil.Process(p.pid).memory_full_info().pss for p in processes)


def memory(args, cache_dir: Path, log: Path, count: int) -> int:
    started = [start_worker(args, cache_dir, log) for _ in range(count)]
    try:
        for process, url in started:
            until_ready(process, url, time.monotonic())
        time.sleep(1)
        return pss_of([process for process, _ in started])
    finally:
        for process, _ in started:
            stop(process)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--kv-cache", default="256MiB")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--share-weights", action="store_true", help="workers keep the mapped weights shared")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="shoal-warm-start-"))
    cache_dir, log = work / "cache", work / "workers.log"
    cold = restart_to_ready(args, cache_dir, log)  # converts the weights and measures the calibration
    warm = [restart_to_ready(args, cache_dir, log) for _ in range(args.runs)]
    one = memory(args, cache_dir, log, 1)
    many = memory(args, cache_dir, log, args.workers)
    result = {
        "model": MODEL,
        "kv_cache": args.kv_cache,
        "threads": args.threads,
        "share_weights": args.share_weights,
        "cold_start_s": cold,
        "warm_restarts_s": warm,
        "warm_restart_median_s": statistics.median(warm),
        "pss_one_worker_bytes": one,
        f"pss_{args.workers}_workers_bytes": many,
        "memory_ratio": many / one,
        "cpus": os.cpu_count(),
        "load_average": os.getloadavg(),
    }
    print(f"cold start (empty cache): {cold:.2f} s")
    print(
        f"warm restart to ready: median {statistics.median(warm):.2f} s, "
        f"runs {', '.join(f'{w:.2f}' for w in warm)} (target <= 3 s)"
    )
    print(
        f"memory (PSS): 1 worker {one / 2**20:.0f} MiB, {args.workers} workers {many / 2**20:.0f} MiB, "
        f"ratio {many / one:.2f} (target <= 1.5)"
    )
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"warm-start-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"results: {path}; logs: {log}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
