"""KV that moves, measured with real worker and router processes (SmolLM2-135M-Instruct, one
thread per worker):

- `pd`: a long-prompt mixed workload on two colocated workers, then on one prefill and one decode
  worker. Short-prompt streams decode throughout while long, uncached prompts arrive every few
  seconds. Reported: the decode streams' inter-token latency (p50, p99) and time to first token of
  both kinds.
- `migration`: a stream with a long prompt moved mid-way from its worker to the other, by a drain
  (SIGTERM: the stream is handed off with its KV) and by a crash (kill -9: recomputed), in turn.
  Reported: the gap at the move (the longest wait for a token over the ten after it), prompt
  tokens the receiver computed, and CPU seconds the receiver spent from the move to the end.
- `tier`: a prefix-heavy workload (more long system prompts, cycled, than the paged cache holds) on
  one worker without and with a host-memory KV tier. Reported: prefix-cache hit rate (the worker's
  own counters) and time to first token.

    .venv/bin/python benchmarks/kv_moves.py pd
    .venv/bin/python benchmarks/kv_moves.py migration --repeats 3
    .venv/bin/python benchmarks/kv_moves.py tier
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil
import yaml
from routing_quality import free_port, wait_for

from shoal.percentile import percentile

RESULTS = Path(__file__).parent / "results"
SECRET = "kv-moves-benchmark"
MODEL = "smollm2"
WORDS = "river stone lantern orchard violet harbor meadow copper falcon willow ember quartz".split()


class Processes:
    """The processes a scenario starts, stopped in reverse order at the end."""

    def __init__(self, log_dir: Path, model: str):
        self.log_dir, self.model, self.started = log_dir, model, []

    def worker(self, name: str, *extra: str) -> tuple[subprocess.Popen, str]:
        port = free_port()
        command = [sys.executable, "-m", "shoal.cli", "worker", "--model", self.model, "--port", str(port)]
        command += ["--served-model-name", MODEL, "--num-threads", "1", *extra]
        process = subprocess.Popen(
            command,
            stdout=subprocess.DEVNULL,
            stderr=open(self.log_dir / f"{name}.log", "a"),  # noqa: SIM115 (the process holds it)
            env={**os.environ, "SHOAL_CLUSTER_SECRET": SECRET},
        )
        self.started.append(process)
        url = f"http://127.0.0.1:{port}"
        wait_for(url + "/ready", process)
        return process, url

    def router(self, name: str, workers: list[str]) -> str:
        port = free_port()
        config = self.log_dir / f"{name}.yaml"
        config.write_text(yaml.safe_dump({"workers": [{"url": u} for u in workers], "state": {"store": "none"}}))
        process = subprocess.Popen(
            [sys.executable, "-m", "shoal.cli", "router", "--port", str(port), "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=open(self.log_dir / f"{name}.log", "a"),  # noqa: SIM115
            env={**os.environ, "SHOAL_CLUSTER_SECRET": SECRET},
        )
        self.started.append(process)
        url = f"http://127.0.0.1:{port}"
        wait_for(url + "/ready", process)
        return url

    def stop(self) -> None:
        for process in reversed(self.started):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    process.kill()
        self.started = []


def text(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, seed: int, on_token=None) -> dict:
    """One streamed chat completion: when each token arrived (seconds since the request)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": seed,
        "ignore_eos": True,
        "stream": True,
    }
    started, times, worker = time.perf_counter(), [], None
    async with client.stream("POST", url + "/v1/chat/completions", json=body, timeout=600) as response:
        worker = response.headers.get("x-shoal-worker")
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            for choice in event.get("choices", ()):
                for _ in choice.get("token_ids") or ():
                    times.append(time.perf_counter() - started)
                    if on_token is not None:
                        on_token(len(times), worker)
    return {"times": times, "worker": worker}


def gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:], strict=False)]


def figures(values: list[float]) -> dict:
    return {
        "p50_ms": round(1000 * (percentile(values, 50) or 0), 1),
        "p99_ms": round(1000 * (percentile(values, 99) or 0), 1),
        "n": len(values),
    }


def counter(url: str, name: str) -> float:
    total = 0.0
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def mixed_workload(url: str, args: argparse.Namespace) -> dict:
    """Decode streams throughout; a long uncached prompt every --long-every-s."""
    rng = random.Random(args.seed)
    decode_gaps, short_ttft, long_ttft = [], [], []
    deadline = time.perf_counter() + args.duration_s
    async with httpx.AsyncClient() as client:

        async def decoder(index: int) -> None:
            number = 0
            while time.perf_counter() < deadline:
                result = await stream(
                    client, url, f"story {index}.{number}: " + text(40, rng), 128, index * 1000 + number
                )
                decode_gaps.extend(gaps(result["times"]))
                short_ttft.append(result["times"][0])
                number += 1

        async def long_prompts() -> None:
            number = 0
            while time.perf_counter() < deadline:
                result = await stream(client, url, f"document {number}: " + text(args.long_words, rng), 8, number)
                long_ttft.append(result["times"][0])
                number += 1
                await asyncio.sleep(args.long_every_s)

        await asyncio.gather(*(decoder(i) for i in range(args.decoders)), long_prompts())
    return {
        "decode_itl": figures(decode_gaps),
        "short_ttft": figures(short_ttft),
        "long_ttft": figures(long_ttft),
    }


def scenario_pd(processes: Processes, args: argparse.Namespace) -> dict:
    results = {}
    for layout, roles in (("colocated", ("colocated", "colocated")), ("disaggregated", ("prefill", "decode"))):
        urls = [
            processes.worker(f"{layout}-{i}", "--role", role, "--kv-cache", "512MiB")[1] for i, role in enumerate(roles)
        ]
        router = processes.router(f"router-{layout}", urls)
        asyncio.run(mixed_workload(router, argparse.Namespace(**{**vars(args), "duration_s": 10})))  # warm-up
        results[layout] = asyncio.run(mixed_workload(router, args))
        results[layout]["handoffs"] = counter(router, "shoal_router_handoffs_total")
        print(layout, results[layout], flush=True)
        processes.stop()
    return results


def scenario_migration(processes: Processes, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    runs = {"drain, with KV": [], "crash, recomputed": []}
    for repeat in range(args.repeats):
        for kind in runs:
            workers = dict(
                processes.worker(f"m{repeat}-{kind[:5]}-{i}", "--kv-cache", "512MiB")[::-1] for i in range(2)
            )
            router = processes.router(f"router-m{repeat}-{kind[:5]}", list(workers))
            moved_at: dict = {}

            def move(tokens: int, worker: str, kind=kind, workers=workers, moved_at=moved_at) -> None:
                if tokens == args.move_after and not moved_at:
                    [receiver] = [u for u in workers if u != worker]
                    moved_at.update(
                        receiver=receiver,
                        computed=counter(receiver, "shoal:prompt_tokens_computed_total"),
                        cpu=sum(psutil.Process(workers[receiver].pid).cpu_times()[:2]),
                    )
                    workers[worker].send_signal(signal.SIGTERM if kind.startswith("drain") else signal.SIGKILL)

            prompt = "summarize: " + text(args.long_words, rng)

            async def one(prompt=prompt, move=move) -> dict:
                async with httpx.AsyncClient() as client:
                    return await stream(client, router, prompt, args.move_after * 2, repeat, on_token=move)

            result = asyncio.run(one())
            receiver = moved_at["receiver"]
            runs[kind].append(
                {
                    "gap_at_move_ms": round(
                        1000 * max(gaps(result["times"][args.move_after - 1 : args.move_after + 10])), 1
                    ),
                    "receiver_computed_tokens": counter(receiver, "shoal:prompt_tokens_computed_total")
                    - moved_at["computed"],
                    "receiver_cpu_s": round(
                        sum(psutil.Process(workers[receiver].pid).cpu_times()[:2]) - moved_at["cpu"], 2
                    ),
                    "tokens": len(result["times"]),
                }
            )
            print(kind, runs[kind][-1], flush=True)
            processes.stop()
    return runs


def scenario_tier(processes: Processes, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    prompts = [f"system prompt {i}: " + text(args.long_words, rng) for i in range(args.prompts)]
    results = {}
    for name, extra in (
        ("no tier", ()),
        ("host tier 512MiB", ("--kv-tier-host-bytes", str(512 << 20))),
    ):
        _, url = processes.worker(name.replace(" ", "-"), "--kv-cache", args.kv_cache, *extra)
        hits, queries = counter(url, "shoal:prefix_cache_hits_total"), counter(url, "shoal:prefix_cache_queries_total")
        ttft = []

        async def cycle(url=url) -> None:
            async with httpx.AsyncClient() as client:
                for round_number in range(args.rounds):
                    for i, prompt in enumerate(prompts):
                        result = await stream(client, url, prompt + f" question {round_number}", 4, i)
                        if round_number:
                            ttft.append(result["times"][0])

        asyncio.run(cycle())
        results[name] = {
            "hit_rate": round(
                (counter(url, "shoal:prefix_cache_hits_total") - hits)
                / max(1.0, counter(url, "shoal:prefix_cache_queries_total") - queries),
                3,
            ),
            "ttft_after_first_round": figures(ttft),
            "tier_hits": counter(url, "shoal:kv_tier_hits_total"),
        }
        print(name, results[name], flush=True)
        processes.stop()
    return results


SCENARIOS = {"pd": scenario_pd, "migration": scenario_migration, "tier": scenario_tier}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scenario", choices=sorted(SCENARIOS))
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=60.0, help="pd: how long each layout is loaded")
    parser.add_argument("--decoders", type=int, default=3, help="pd: concurrent decode streams")
    parser.add_argument("--long-words", type=int, default=700, help="words in a long prompt (about 1.5 tokens each)")
    parser.add_argument("--long-every-s", type=float, default=3.0, help="pd: pause between long prompts")
    parser.add_argument("--repeats", type=int, default=3, help="migration: moves of each kind")
    parser.add_argument("--move-after", type=int, default=40, help="migration: tokens before the move")
    parser.add_argument("--prompts", type=int, default=8, help="tier: system prompts cycled")
    parser.add_argument("--rounds", type=int, default=3, help="tier: times each prompt is sent")
    parser.add_argument("--kv-cache", default="48MiB", help="tier: the paged cache (holds a few prompts)")
    args = parser.parse_args()
    processes = Processes(Path(tempfile.mkdtemp(prefix=f"shoal-kv-{args.scenario}-")), args.model)
    try:
        results = SCENARIOS[args.scenario](processes, args)
    finally:
        processes.stop()
    RESULTS.mkdir(exist_ok=True)
    output = RESULTS / f"kv-moves-{args.scenario}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    output.write_text(json.dumps({"args": vars(args), "cpus": os.cpu_count(), "results": results}, indent=1))
    print(f"results in {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
