"""Goodput (requests that met their latency targets, per second) on a real cluster: two shoal workers
(one thread each) behind a fresh shoal router per run, an open-loop Poisson load of streamed chat
requests with prompts of very different lengths, every request with the same TTFT and TPOT targets
and every other one sheddable (each worker first warmed up by a few requests of its own; each run's
prompts start with the run's name, so none finds another run's prefixes cached). Runs, interleaved over --repeats on the same requests:

- `cost!` the router not told the targets (no target headers: no target placement, no shedding;
  the targets still score the requests);
- `cost` told them (placement where they are predicted met, sheddable work refused at once with a
  429 where no worker can meet them);
- `llm_d_latency` told them (llm-d's predicted-latency rule, shoal.router.placement.policies.
  peer_llm_d_latency, fed the router's predictions; the same admission).

Met: the first token within the TTFT target and (output tokens - 1) / (last - first token) within
the TPOT target, as the client sees them; a refused or failed request missed. Goodput: met requests
over the time from the first send to the last answer. Pick --rate where `cost!` misses about a
fifth (its figures are printed each run).

    .venv/bin/python benchmarks/goodput_cluster.py [--rate 1.2] [--requests 120] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from cpu_name import cpu_description
from routing_quality import free_port, start_router, wait_for

RESULTS = Path(__file__).parent / "results"
NAME = "bench"
WORDS = "harbour lantern granite meadow falcon copper willow ember summit tide orchard quarry".split()
RUNS = {"cost!": ("cost", False), "cost": ("cost", True), "llm_d_latency": ("llm_d_latency", True)}


def requests(args) -> list[dict]:
    """The workload, the same every run: arrival offset, prompt, output tokens, sheddable or not."""
    rng = random.Random(args.seed)
    at, made = 0.0, []
    for index in range(args.requests):
        at += rng.expovariate(args.rate)
        words = rng.randint(*args.long_words) if rng.random() < args.long_share else rng.randint(*args.short_words)
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        made.append({"at": at, "prompt": prompt, "max_tokens": rng.randint(16, 64), "sheddable": index % 2 == 1})
    return made


async def one(client: httpx.AsyncClient, request: dict, told: bool, args, started: float, run_id: str) -> dict:
    await asyncio.sleep(max(0.0, started + request["at"] - time.monotonic()))
    headers = {"x-shoal-priority": "sheddable"} if request["sheddable"] else {}
    if told:
        headers |= {
            "x-shoal-ttft-target-ms": str(args.ttft_target_ms),
            "x-shoal-tpot-target-ms": str(args.tpot_target_ms),
        }
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": f"{run_id} {request['prompt']}"}],  # no run finds another's cached
        "max_tokens": request["max_tokens"],
        "ignore_eos": True,
        "stream": True,
    }
    sent = time.monotonic()
    first = last = None
    async with client.stream("POST", "/v1/chat/completions", json=body, headers=headers) as answer:
        if answer.status_code != 200:
            await answer.aread()
            return {"status": answer.status_code, "met": False, "ended": time.monotonic()}
        async for line in answer.aiter_lines():
            if line.startswith("data: {") and '"content"' in line:
                last = time.monotonic()
                first = first or last
    ended = time.monotonic()
    if first is None:
        return {"status": 200, "met": False, "ended": ended}
    ttft = first - sent
    tpot = (last - first) / (request["max_tokens"] - 1)
    met = ttft * 1000 <= args.ttft_target_ms and tpot * 1000 <= args.tpot_target_ms
    return {"status": 200, "met": met, "ttft_s": ttft, "tpot_s": tpot, "ended": ended}


def warm_up(url: str, load: list[dict]) -> None:
    """A worker's first requests, short and long, one at a time: its first steps of each shape are
    slower than the rest."""
    for request in load:
        body = {"model": NAME, "messages": [{"role": "user", "content": request["prompt"]}], "max_tokens": 8}
        httpx.post(url + "/v1/chat/completions", json=body, timeout=300).raise_for_status()


def run(worker_urls: list[str], work: Path, args, name: str, load: list[dict], repeat: int) -> dict:
    policy, told = RUNS[name]
    config = {"workers": [{"url": url} for url in worker_urls], "policy": policy, "health": {"canary_interval_s": 3600}}
    router, url = start_router(config, work, f"router-{policy}")
    try:

        async def everyone() -> list[dict]:
            async with httpx.AsyncClient(base_url=url, timeout=600) as client:
                started = time.monotonic()
                run_id = f"run-{repeat}-{name}"
                done = await asyncio.gather(*(one(client, r, told, args, started, run_id) for r in load))
                return [{**d, "ended": d["ended"] - started} for d in done]

        done = asyncio.run(everyone())
    finally:
        router.terminate()
        router.wait(timeout=30)
    served = [d for d in done if d["status"] == 200 and "ttft_s" in d]
    met = sum(d["met"] for d in done)
    wall = max(d["ended"] for d in done)
    return {
        "run": name,
        "met_share": met / len(done),
        "shed": sum(d["status"] == 429 for d in done),
        "failed": sum(d["status"] not in (200, 429) for d in done),
        "goodput": met / wall,
        "ttft_p50_ms": 1000 * statistics.median(d["ttft_s"] for d in served) if served else None,
        "ttft_p99_ms": 1000 * sorted(d["ttft_s"] for d in served)[int(0.99 * (len(served) - 1))] if served else None,
        "wall_s": wall,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=1.2, help="arrivals a second (Poisson)")
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--ttft-target-ms", type=float, default=1500)
    parser.add_argument("--tpot-target-ms", type=float, default=150)
    parser.add_argument("--long-share", type=float, default=0.15)
    parser.add_argument("--short-words", type=int, nargs=2, default=(20, 150))
    parser.add_argument("--long-words", type=int, nargs=2, default=(600, 900))
    parser.add_argument("--runs", default=",".join(RUNS), help=f"among {', '.join(RUNS)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    names = args.runs.split(",")
    work = Path(tempfile.mkdtemp(prefix="shoal-goodput-"))
    workers, urls = [], []
    for number in range(2):
        port = free_port()
        argv = [sys.executable, "-m", "shoal.cli", "worker", "--port", str(port), "--served-model-name", NAME]
        workers.append(
            subprocess.Popen(
                [*argv, "--num-threads", "1"], stdout=subprocess.DEVNULL, stderr=open(work / f"worker{number}.log", "a")
            )
        )
        urls.append(f"http://127.0.0.1:{port}")
    rows = []
    try:
        for process, url in zip(workers, urls, strict=True):
            wait_for(url + "/ready", process)
            warm_up(url, requests(argparse.Namespace(**{**vars(args), "requests": 8, "seed": -1})))
        load = requests(args)
        for repeat in range(args.repeats):
            for name in names:
                row = {**run(urls, work, args, name, load, repeat), "repeat": repeat}
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        for process in workers:
            process.terminate()
            process.wait(timeout=30)
    print(f"CPU: {cpu_description()}; rate {args.rate}/s, {args.requests} requests, {args.repeats} repeats")
    print("| run | met | shed | goodput req/s | TTFT p99 | vs llm_d_latency (by repeat) |")
    print("|---|--:|--:|--:|--:|--|")
    for name in names:
        mine = [r for r in rows if r["run"] == name]
        reference = [r for r in rows if r["run"] == "llm_d_latency"]
        ratios = [a["goodput"] / b["goodput"] for a, b in zip(mine, reference, strict=False)]
        ratio = f"**{statistics.median(ratios):.2f}x** ({', '.join(f'{r:.2f}' for r in ratios)})" if ratios else "-"
        print(
            f"| {name} | {statistics.median(r['met_share'] for r in mine):.1%} | "
            f"{statistics.median(r['shed'] for r in mine):.0f} | {statistics.median(r['goodput'] for r in mine):.3f} | "
            f"{statistics.median(r['ttft_p99_ms'] or 0 for r in mine):,.0f} ms | {ratio} |"
        )
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"goodput-cluster-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps({"args": vars(args), "cpu": cpu_description(), "runs": rows}, indent=1))
    print(f"written: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
