"""A batch on spare capacity: interactive streams at a steady Poisson rate through a router, first
alone, then while a batch of `--batch-requests` runs; in both runs the router is killed (kill -9)
and restarted on the same port and state at the same moment. Reported: interactive TTFT
percentiles of each run and their ratio, the batch's lines lost and duplicated (from its output and
error files), the requests the worker ran beyond the batch and the interactive ones (lines cut off
by the kill run again), and how long the batch took.

    .venv/bin/python benchmarks/batch_spare_capacity.py                  # SmolLM2-135M-Instruct
    .venv/bin/python benchmarks/batch_spare_capacity.py --tiny           # tiny random Llama, fast
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import yaml
from cpu_name import cpu_description
from routing_quality import free_port, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.tiny_model import write_tiny_model

RESULTS = Path(__file__).parent / "results"
SERVED = "bench"
WORDS = "river stone lantern harbor meadow signal copper orchard falcon ember glacier canyon".split()


def prompt(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class Router:
    """One router on a fixed port and state directory, killed and started again as asked."""

    def __init__(self, worker_url: str, state_dir: Path, log_dir: Path, max_in_flight: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.config = log_dir / f"router-{state_dir.name}.yaml"
        self.log = log_dir / f"router-{state_dir.name}.log"
        self.config.write_text(
            yaml.safe_dump(
                {
                    "workers": [{"url": worker_url}],
                    "state": {
                        "store": "sqlite",
                        "sqlite_path": str(state_dir / "state.sqlite3"),
                        "files_dir": str(state_dir / "files"),
                    },
                    "batches": {"max_in_flight": max_in_flight},
                    "health": {"canary_interval_s": 3600},  # the worker's request count is the clients' alone
                }
            )
        )
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        with open(self.log, "a") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "shoal.cli", "router", "--port", str(self.port), "--config", str(self.config)],
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        wait_for(self.url + "/ready", self.process, timeout_s=60)

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)


async def interactive(url: str, args, rng: random.Random, duration_s: float, records: list[dict]) -> None:
    """Open-loop Poisson arrivals for `duration_s`; each stream's TTFT, or its failure."""

    async def one(client: httpx.AsyncClient, body: dict) -> None:
        sent = time.perf_counter()
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                if response.status_code != 200:
                    records.append({"error": response.status_code, "body": (await response.aread())[:300]})
                    return
                first = None
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: ") and '"content"' in line:
                        first = time.perf_counter() - sent
                records.append({"ttft_s": first} if first is not None else {"error": "no output"})
        except httpx.HTTPError as exc:
            records.append({"error": type(exc).__name__})

    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(120, connect=5)) as client:
        tasks, started = [], time.perf_counter()
        while time.perf_counter() - started < duration_s:
            body = {
                "model": SERVED,
                "messages": [{"role": "user", "content": prompt(rng, args.prompt_words)}],
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
                "stream": True,
            }
            tasks.append(asyncio.create_task(one(client, body)))
            await asyncio.sleep(rng.expovariate(args.rate))
        await asyncio.gather(*tasks)


async def run(router: Router, worker_url: str, args, with_batch: bool) -> dict:
    rng = random.Random(args.seed)
    router.start()
    before = requests_finished(worker_url)
    batch_id = None
    if with_batch:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=3)
        lines = [
            {
                "custom_id": f"line-{i}",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "model": SERVED,
                    "messages": [{"role": "user", "content": prompt(rng, args.prompt_words)}],
                    "max_tokens": args.batch_max_tokens,
                    "ignore_eos": True,
                },
            }
            for i in range(args.batch_requests)
        ]
        data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
        source = client.files.create(file=("batch.jsonl", io.BytesIO(data)), purpose="batch")
        batch_id = client.batches.create(
            input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h"
        ).id
    started = time.perf_counter()
    records: list[dict] = []

    async def restart() -> None:
        await asyncio.sleep(args.kill_after_s)
        router.kill()
        await asyncio.to_thread(router.start)

    await asyncio.gather(interactive(router.url, args, rng, args.duration_s, records), restart())
    result = {"interactive": summarise(records)}
    if with_batch:
        client = openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=3)
        while (batch := client.batches.retrieve(batch_id)).status not in (
            "completed",
            "failed",
            "expired",
            "cancelled",
        ):
            await asyncio.sleep(1)
        outputs = client.files.content(batch.output_file_id).text.splitlines() if batch.output_file_id else []
        errors = client.files.content(batch.error_file_id).text.splitlines() if batch.error_file_id else []
        seen = [json.loads(line)["custom_id"] for line in outputs + errors]
        expected = {f"line-{i}" for i in range(args.batch_requests)}
        result["batch"] = {
            "status": batch.status,
            "completed": batch.request_counts.completed,
            "failed": batch.request_counts.failed,
            "lost": len(expected - set(seen)),
            "duplicated": len(seen) - len(set(seen)),
            "seconds": round(time.perf_counter() - started, 1),
        }
    ran = requests_finished(worker_url) - before
    result["worker_requests"] = ran
    # Requests the worker finished beyond the interactive streams that got an answer and the batch's
    # lines: those cut off by the kill (interactive streams among them) that ran again.
    result["ran_again"] = ran - len([r for r in records if "ttft_s" in r]) - (args.batch_requests if with_batch else 0)
    router.kill()
    return result


def requests_finished(worker_url: str) -> float:
    text = httpx.get(worker_url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("shoal:e2e_request_latency_seconds_count")
    )


def summarise(records: list[dict]) -> dict:
    ttfts = [r["ttft_s"] for r in records if "ttft_s" in r]
    if not ttfts:
        raise RuntimeError(f"no stream got a first token: {records[:5]}")
    return {
        "streams": len(ttfts),
        "failed": len(records) - len(ttfts),
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
        "ttft_p90_ms": round(1000 * percentile(ttfts, 0.90), 1),
        "ttft_p99_ms": round(1000 * percentile(ttfts, 0.99), 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--rate", type=float, default=1.0, help="interactive streams per second")
    parser.add_argument("--duration-s", type=float, default=240)
    parser.add_argument("--kill-after-s", type=float, default=60)
    parser.add_argument("--prompt-words", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--batch-requests", type=int, default=1000)
    parser.add_argument("--batch-max-tokens", type=int, default=8)
    parser.add_argument("--max-in-flight", type=int, default=8, help="the router's batches.max_in_flight")
    parser.add_argument("--background-step-tokens", type=int, default=32, help="the worker engine setting")
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="shoal-batch-bench-"))
    model = str(write_tiny_model(log_dir / "tiny-llama")) if args.tiny else args.model
    worker_port = free_port()
    worker_url = f"http://127.0.0.1:{worker_port}"
    worker = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "worker", "--model", model, "--port", str(worker_port)]
        + ["--served-model-name", SERVED, "--kv-cache", "512MiB"]
        + ["--background-step-tokens", str(args.background_step_tokens)]
        + (["--dtype", "float32", "--step-delay-ms", "10"] if args.tiny else []),
        stdout=subprocess.DEVNULL,
        stderr=open(log_dir / "worker.log", "a"),
    )
    try:
        wait_for(worker_url + "/ready", worker)
        results = {}
        for name, with_batch in (("alone", False), ("with_batch", True)):
            state = log_dir / name
            state.mkdir()
            results[name] = asyncio.run(
                run(Router(worker_url, state, log_dir, args.max_in_flight), worker_url, args, with_batch)
            )
            print(name, json.dumps(results[name]), flush=True)
    finally:
        worker.terminate()
        worker.wait(timeout=30)
    alone, loaded = results["alone"]["interactive"], results["with_batch"]["interactive"]
    report = {
        "cpu": cpu_description(),
        "args": vars(args),
        **results,
        "ttft_p99_ratio": round(loaded["ttft_p99_ms"] / alone["ttft_p99_ms"], 2),
        "ttft_p50_ratio": round(loaded["ttft_p50_ms"] / alone["ttft_p50_ms"], 2),
    }
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"batch-spare-capacity-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("ttft_p99_ratio", "ttft_p50_ratio")}), "->", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
