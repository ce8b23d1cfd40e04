"""Many LoRA adapters on one fleet: `--workers` shoal workers (one thread each) reading adapters on
demand from one directory, each holding at most `--max-cpu-loras` in memory, behind a router that
has `--adapters` random rank-`--rank` adapters catalogued (on_demand: loaded where requests need
them). Streamed completions arrive open loop (Poisson, `--rate` a second, for `--duration-s`), each
naming an adapter drawn from a Zipf law (exponent `--zipf`): a few adapters take most requests.

Each routing policy gets a fresh fleet (nothing held) and the same arrivals. Reported per policy:
the placement hit rate (requests that found their adapter in memory where they were placed: one
minus the adapter reads the workers made over the requests), TTFT p50 and p99, and failures.
`cost` is shoal's default, adapter-aware (a worker not holding the adapter is charged its read; a
holder is the adapter's home); `least_outstanding_tokens` places by load alone, ignoring adapters.

    .venv/bin/python benchmarks/lora_fleet.py [--workers 3] [--adapters 24] [--rate 3] [--duration-s 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from cpu_name import cpu_description
from lora_throughput import write_random_adapter
from routing_quality import free_port, wait_for
from speculative import shoal_worker, start

from shoal.model.inspection import inspect_model

RESULTS = Path(__file__).parent / "results"
ADMIN = "lora-fleet-admin"
WORDS = "harbor lantern keeper tide gull rope anchor storm beacon shore compass chart sail reef".split()


def zipf_weights(count: int, exponent: float) -> list[float]:
    return [1 / (rank**exponent) for rank in range(1, count + 1)]


def arrivals(args, names: list[str]) -> list[tuple[float, str, str]]:
    """(send time, adapter, prompt) of every request: the same for each policy."""
    rng = random.Random(args.seed)
    weights = zipf_weights(len(names), args.zipf)
    at, planned = 0.0, []
    while at < args.duration_s:
        prompt = " ".join(rng.choice(WORDS) for _ in range(args.prompt_words))
        planned.append((at, rng.choices(names, weights)[0], prompt))
        at += rng.expovariate(args.rate)
    return planned


async def drive(url: str, planned: list[tuple[float, str, str]], max_tokens: int) -> list[dict]:
    """Sends each request at its time, streamed; each one's TTFT and worker, or its failure."""
    records: list[dict] = []

    async def one(client: httpx.AsyncClient, adapter: str, prompt: str) -> None:
        body = {"model": adapter, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        sent = time.perf_counter()
        try:
            async with client.stream("POST", "/v1/completions", json=body) as response:
                if response.status_code != 200:
                    records.append({"error": response.status_code})
                    return
                first = None
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: ") and '"text"' in line:
                        first = time.perf_counter() - sent
                records.append({"ttft_s": first, "worker": response.headers.get("x-shoal-worker")})
        except httpx.HTTPError as exc:
            records.append({"error": type(exc).__name__})

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(300, connect=5)) as client:
        started, tasks = time.perf_counter(), []
        for at, adapter, prompt in planned:
            await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
            tasks.append(asyncio.create_task(one(client, adapter, prompt)))
        await asyncio.gather(*tasks)
    return records


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def reads(worker_urls: list[str]) -> int:
    return sum(httpx.get(url + "/load", timeout=10).json()["lora"]["loads"] for url in worker_urls)


def run_policy(policy: str, args, work: Path, names: list[str], planned) -> dict:
    flags = ["--num-threads", "1", "--enable-lora", "--max-loras", str(args.max_cpu_loras)]
    flags += ["--max-cpu-loras", str(args.max_cpu_loras), "--max-lora-rank", str(args.rank), "--lora-dir", str(work)]
    workers = [start(shoal_worker(args.model, flags), work / f"{policy}-worker-{i}.log") for i in range(args.workers)]
    urls = [url for _, url in workers]
    port = free_port()
    config = work / f"router-{policy}.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "policy": policy,
                "workers": [{"url": url} for url in urls],
                "state": {"store": "none"},
                "health": {"canary_interval_s": 3600},
            }
        )
    )
    with open(work / f"router-{policy}.log", "a") as log:
        router = subprocess.Popen(
            [sys.executable, "-m", "shoal.cli", "router", "--port", str(port), "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=log,
            env={**os.environ, "SHOAL_ADMIN_TOKEN": ADMIN},
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for(url + "/ready", router, timeout_s=60)
        admin = {"authorization": f"Bearer {ADMIN}"}
        for name in names:
            change = {"lora_name": name, "lora_path": name, "on_demand": True}
            httpx.post(url + "/v1/load_lora_adapter", json=change, headers=admin, timeout=60).raise_for_status()
        before = reads(urls)
        records = asyncio.run(drive(url, planned, args.max_tokens))
        read = reads(urls) - before
    finally:
        router.terminate()
        router.wait(timeout=30)
        for process, _ in workers:
            process.terminate()
            process.wait(timeout=30)
    served = [r for r in records if "ttft_s" in r and r["ttft_s"] is not None]
    ttfts = [r["ttft_s"] for r in served]
    return {
        "requests": len(records),
        "failed": len(records) - len(served),
        "adapter_reads": read,
        "placement_hit_rate": round(1 - read / max(1, len(served)), 3),
        "ttft_p50_ms": round(1000 * percentile(ttfts, 0.5), 1),
        "ttft_p99_ms": round(1000 * percentile(ttfts, 0.99), 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--adapters", type=int, default=24)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--max-cpu-loras", type=int, default=4)
    parser.add_argument("--zipf", type=float, default=1.1)
    parser.add_argument("--rate", type=float, default=3.0, help="requests a second")
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--prompt-words", type=int, default=60)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--policies", default="cost,least_outstanding_tokens")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="shoal-lora-fleet-"))
    config = inspect_model(args.model).config
    names = [f"adapter-{i:02d}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        write_random_adapter(work / name, config, args.rank, seed=i)
    planned = arrivals(args, names)
    results = {}
    for policy in args.policies.split(","):
        results[policy] = run_policy(policy, args, work, names, planned)
        print(policy, json.dumps(results[policy]), flush=True)
    report = {"cpu": cpu_description(), **{k: v for k, v in vars(args).items() if k != "policies"}, "results": results}
    print(json.dumps(report, indent=2), flush=True)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"lora-fleet-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(report, indent=2))
    print("->", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
