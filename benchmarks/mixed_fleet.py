"""Placement across engines: a shoal worker, a llama.cpp server (llama-cpp-python, one request at a
time) and a vLLM CPU server, all serving SmolLM2 under one model name behind one shoal router, under
the same load for each policy. Reported per policy: where the requests went, TTFT and end-to-end
latency as the client sees them, output tokens/s and the wall time of the whole load.

The engines start once (vLLM takes about 80 s), each answers one request directly (its first
request is much slower than the rest: llama.cpp's took 16-19 s here), and they serve every policy
in turn; each policy gets a fresh router. The peers come from benchmarks/.peers (peer_venv.py installs them on first use).

    .venv/bin/python benchmarks/mixed_fleet.py [--policies cost,round_robin] [--requests 48] [--concurrency 12]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from peer_servers import VLLM_ENVIRONMENT, llama_server_command, vllm_server_command
from peer_venv import python_of
from routing_quality import free_port, wait_for

from shoal.model.registry import resolve_model
from shoal.percentile import percentile

RESULTS = Path(__file__).parent / "results"
NAME = "smollm2"
TOPICS = ["lighthouses", "volcanoes", "bees", "trains", "glaciers", "owls", "bridges", "comets"]


def start(argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        argv, stdout=log.open("ab"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True
    )


def start_engines(log_dir: Path) -> tuple[dict[str, str], list[subprocess.Popen]]:
    gguf = resolve_model("smollm2-135m-instruct").path
    ports = {engine: free_port() for engine in ("shoal", "llama.cpp", "vllm")}
    urls = {engine: f"http://127.0.0.1:{port}" for engine, port in ports.items()}
    llama, vllm = python_of("llama-cpp", print), python_of("vllm", print)
    processes = [
        start(
            [sys.executable, "-m", "shoal.cli", "worker", "--port", str(ports["shoal"])]
            + ["--served-model-name", NAME, "--num-threads", "1"],
            log_dir / "shoal.log",
        ),
        start(llama_server_command(llama, gguf, NAME, ports["llama.cpp"]), log_dir / "llama.log"),
        start(vllm_server_command(vllm, gguf, NAME, ports["vllm"], print), log_dir / "vllm.log", env=VLLM_ENVIRONMENT),
    ]
    for engine, url in urls.items():
        wait_for(url + "/v1/models", processes[list(urls).index(engine)], timeout_s=600)
        warm_up = {"model": NAME, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8}
        httpx.post(url + "/v1/chat/completions", json=warm_up, timeout=300).raise_for_status()
        print(f"  {engine} up at {url} (warmed up by one request)")
    return urls, processes


async def load(router_url: str, args) -> list[dict]:
    gate = asyncio.Semaphore(args.concurrency)

    async def one(client: httpx.AsyncClient, i: int) -> dict:
        body = {
            "model": NAME,
            "messages": [{"role": "user", "content": f"Write a long story about {TOPICS[i % len(TOPICS)]}, part {i}."}],
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "stream": True,
        }
        async with gate:
            started, first, tokens = time.perf_counter(), None, 0
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                worker = response.headers["x-shoal-worker"]
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    for choice in json.loads(line[6:])["choices"]:
                        if (choice.get("delta") or {}).get("content"):
                            first, tokens = first or time.perf_counter(), tokens + 1
            return {
                "worker": worker,
                "sent_s": started - began,
                "ttft_s": first - started,
                "e2e_s": time.perf_counter() - started,
                "tokens": tokens,
            }

    began = time.perf_counter()
    async with httpx.AsyncClient(base_url=router_url, timeout=600) as client:
        return await asyncio.gather(*(one(client, i) for i in range(args.requests)))


def run_policy(policy: str, urls: dict[str, str], args, log_dir: Path) -> dict:
    port = free_port()
    config = log_dir / f"router-{policy}.yaml"
    config.write_text(json.dumps({"workers": [{"url": u} for u in urls.values()], "policy": policy}))
    router = start(
        [sys.executable, "-m", "shoal.cli", "router", "--port", str(port), "--config", str(config)],
        log_dir / f"router-{policy}.log",
    )
    try:
        wait_for(f"http://127.0.0.1:{port}/health", router)
        time.sleep(2)  # a few polls: every engine's load known
        started = time.perf_counter()
        results = asyncio.run(load(f"http://127.0.0.1:{port}", args))
        wall = time.perf_counter() - started
    finally:
        router.terminate()
        router.wait(timeout=30)
    engine_of = {url: engine for engine, url in urls.items()}
    counts = Counter(engine_of[r["worker"]] for r in results)
    ttft, e2e = [r["ttft_s"] for r in results], [r["e2e_s"] for r in results]
    row = {
        "policy": policy,
        "requests": {engine: counts.get(engine, 0) for engine in urls},
        "ttft_p50_s": percentile(ttft, 50),
        "ttft_p99_s": percentile(ttft, 99),
        "e2e_p50_s": percentile(e2e, 50),
        "e2e_p99_s": percentile(e2e, 99),
        "tokens_per_s": sum(r["tokens"] for r in results) / wall,
        "wall_s": wall,
        "per_request": [
            {"engine": engine_of[r["worker"]], **{k: round(r[k], 3) for k in ("sent_s", "ttft_s", "e2e_s")}}
            for r in results
        ],
        "ttft_p99_s_by_engine": {
            engine: percentile([r["ttft_s"] for r in results if engine_of[r["worker"]] == engine], 99)
            for engine in counts
        },
    }
    print(
        f"  {policy:26s} shoal/llama.cpp/vllm {counts.get('shoal', 0):3d}/{counts.get('llama.cpp', 0):3d}/"
        f"{counts.get('vllm', 0):3d}  TTFT p50 {row['ttft_p50_s'] * 1000:6.0f} ms p99 {row['ttft_p99_s'] * 1000:6.0f} ms"
        f"  e2e p50 {row['e2e_p50_s']:5.1f} s p99 {row['e2e_p99_s']:5.1f} s  {row['tokens_per_s']:6.1f} tok/s  wall {wall:5.1f} s"
    )
    by_engine = ", ".join(f"{e} {s * 1000:.0f} ms" for e, s in sorted(row["ttft_p99_s_by_engine"].items()))
    print(f"    TTFT p99 by engine: {by_engine}")
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="cost,least_outstanding_tokens,round_robin")
    parser.add_argument("--requests", type=int, default=48)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="shoal-mixed-fleet-"))
    print(f"logs in {log_dir}")
    urls, processes = start_engines(log_dir)
    try:
        rows = [run_policy(policy, urls, args, log_dir) for policy in args.policies.split(",")]
    finally:
        for process in processes:
            os.killpg(process.pid, signal.SIGKILL)
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"mixed-fleet-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
