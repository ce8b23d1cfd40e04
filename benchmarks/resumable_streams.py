"""What a stream journal costs: the same streamed requests through a router without and with
`resumable_streams` (Redis), against one worker, in alternating rounds. Reported: inter-token and
first-token latency percentiles of each, and the journal's Redis round trips and commands per token
(from the server's INFO commandstats).

    .venv/bin/python benchmarks/resumable_streams.py            # SmolLM2-135M-Instruct
    .venv/bin/python benchmarks/resumable_streams.py --tiny     # tiny random Llama, fast
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import redis
from chaos import latency, make_spec, run_phase
from routing_quality import free_port, start_router, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.redis_server import start_redis_server
from tests.support.tiny_model import write_tiny_model

RESULTS = Path(__file__).parent / "results"


def commandstats(redis_url: str) -> dict[str, int]:
    """Calls per command so far (INFO commandstats)."""
    stats = redis.Redis.from_url(redis_url).info("commandstats")
    return {name.removeprefix("cmdstat_"): figures["calls"] for name, figures in stats.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--requests", type=int, default=24, help="per round and router")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--flush-tokens", type=int, default=16)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="shoal-resumable-"))
    model = str(write_tiny_model(log_dir / "tiny-llama")) if args.tiny else args.model
    redis, redis_url = start_redis_server(log_dir)
    worker_port = free_port()
    worker = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "worker", "--model", model, "--port", str(worker_port)]
        + ["--served-model-name", "chaos", "--kv-cache", "256MiB", "--num-threads", "1"]
        + (["--dtype", "float32", "--step-delay-ms", "20"] if args.tiny else []),
        stdout=subprocess.DEVNULL,
        stderr=open(log_dir / "worker.log", "a"),
    )
    processes = [redis, worker]
    try:
        wait_for(f"http://127.0.0.1:{worker_port}/ready", worker)
        base = {"workers": [{"url": f"http://127.0.0.1:{worker_port}"}], "state": {"store": "none"}}
        journaled = {
            **base,
            "resumable_streams": {"store": "redis", "redis_url": redis_url, "flush_tokens": args.flush_tokens},
        }
        plain_router, plain_url = start_router(base, log_dir, "plain")
        journal_router, journal_url = start_router(journaled, log_dir, "journaled")
        processes += [plain_router, journal_router]
        records = {"plain": [], "journaled": []}
        warm = argparse.Namespace(seed=args.seed, max_tokens=args.max_tokens)
        asyncio.run(run_phase(plain_url, lambda i: make_spec(10_000 + i, warm), args.concurrency, {}, count=8))
        before = commandstats(redis_url)
        for round_number in range(args.rounds):
            for name, url in (("plain", plain_url), ("journaled", journal_url)):
                first = round_number * args.requests
                done, _ = asyncio.run(
                    run_phase(url, lambda i: make_spec(first + i, warm), args.concurrency, {}, count=args.requests)
                )
                records[name] += done
                print(f"round {round_number + 1}: {name} {latency(done)}", flush=True)
        after = commandstats(redis_url)
    finally:
        for process in reversed(processes):
            process.terminate()
            process.wait(timeout=30)
    calls = {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}
    tokens = sum(len(r["ids"]) for r in records["journaled"])
    failed = {name: sum(1 for r in rs if r["error"]) for name, rs in records.items()}
    result = {
        "args": vars(args),
        "cpus": os.cpu_count(),
        "latency": {name: latency(rs) for name, rs in records.items()},
        "failed": failed,
        "journaled_tokens": tokens,
        "redis_calls": calls,
        "round_trips_per_1000_tokens": 1000 * calls.get("exec", 0) / max(tokens, 1),
        "commands_per_1000_tokens": 1000
        * sum(v for k, v in calls.items() if k not in ("exec", "multi", "info"))
        / max(tokens, 1),
    }
    for name, figures in result["latency"].items():
        print(
            f"{name:>9}: ITL p50 {figures['itl_p50_s'] * 1e3:.1f} ms p99 {figures['itl_p99_s'] * 1e3:.1f} ms, "
            f"TTFT p50 {figures['ttft_p50_s'] * 1e3:.0f} ms p99 {figures['ttft_p99_s'] * 1e3:.0f} ms"
        )
    print(
        f"journal: {result['round_trips_per_1000_tokens']:.1f} Redis round trips and "
        f"{result['commands_per_1000_tokens']:.1f} commands per 1000 tokens; calls {calls}; failed {failed}"
    )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"resumable-streams-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps(result, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
