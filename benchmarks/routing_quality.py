"""Routing quality: the default cost policy against round robin (and any other policy named) on
a multi-turn chat workload with shared system prompts, over 3+ real workers; the peers' routers
too, as `ROUTER:POLICY` (`smg:cache_aware` for SGLang's Model Gateway, `vllm-router:cache_aware`),
each installed in its own venv (peer_venv) and run in front of the same shoal workers. shoal's
router follows the workers' KV events; `POLICY@guessed` runs it guessing their caches instead.

Per router, fresh workers and a fresh router are started (so no router inherits another's caches);
a warm-up run of other conversations over the same system prompts places them and makes the
workers' first calls (--no-warmup leaves it out), then the measured conversations run concurrently,
each turn waiting for the previous reply (which joins the history). Reported per policy: the workers' prefix-cache hit rate (hit tokens / queried tokens, from
their /metrics), time to first token p50/p99 as the client sees it, completion tokens/s and the
run's wall time; with --repeats N, the runs of the policies interleave and the medians are reported.

    .venv/bin/python benchmarks/routing_quality.py [--workers 3] [--policies cost,round_robin,smg:cache_aware]

Slow workers (the first --slow-workers take at least --slow-step-ms a step, as a slower machine
does): `--workers 3 --slow-workers 1 --slow-step-ms 60`.

Mixed engines (the last --llama-cpp-workers of the workers are llama.cpp servers, llama-cpp-python
from its peer venv, on the same GGUF with one thread: they report no load, no KV events and no
metrics, so the hit rate and the token shares are the shoal workers' alone):
`--workers 3 --llama-cpp-workers 1`.

Under KV pressure (each worker's cache holds only a few conversations), against both peers' routers:

    .venv/bin/python benchmarks/routing_quality.py --workers 2 --kv-cache 48MiB --system-prompts 6 \
        --conversations 12 --turns 4 --concurrency 4 \
        --policies cost,cache_aware,round_robin,smg:cache_aware,vllm-router:cache_aware
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from cpu_name import cpu_description
from peer_servers import llama_server_command
from peer_venv import peer_program, python_of
from worker_metrics import worker_counters

RESULTS = Path(__file__).parent / "results"
TOPICS = [
    "astronomy",
    "cooking",
    "gardening",
    "chess",
    "sailing",
    "geology",
    "music theory",
    "carpentry",
    "beekeeping",
    "photography",
    "cycling",
    "birdwatching",
    "pottery",
    "weather",
    "origami",
    "rowing",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, process: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url} exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not come up")


def start_router(config: dict, log_dir: Path, name: str) -> tuple[subprocess.Popen, str]:
    """A shoal router on a free port with `config` (written to log_dir/NAME.yaml, its log beside it),
    once it is ready; (process, URL)."""
    port = free_port()
    path = log_dir / f"{name}.yaml"
    path.write_text(json.dumps(config))
    with open(log_dir / f"{name}.log", "a") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "shoal.cli", "router", "--port", str(port), "--config", str(path)],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    url = f"http://127.0.0.1:{port}"
    wait_for(url + "/ready", process, timeout_s=60)
    return process, url


def gguf_of(model: str) -> Path:
    """The GGUF file a model name or path stands for (what a llama.cpp server loads)."""
    from shoal.model.registry import resolve_model

    return Path(resolve_model(model).path)


def system_prompt(topic: str, rng: random.Random) -> str:
    facts = " ".join(
        f"Rule {i + 1}: when asked about {topic}, mention detail number {rng.randrange(1000)} and keep "
        f"answers short, friendly and precise."
        for i in range(8)
    )
    return f"You are an expert assistant on {topic}. {facts}"


def make_conversations(args, questions_seed: int) -> list[tuple[str, list[str]]]:
    """Conversations over the run's system prompts (from --seed), with questions of their own (from
    questions_seed): a warm-up and the measured run share the system prompts, nothing else."""
    rng = random.Random(args.seed)
    systems = [system_prompt(topic, rng) for topic in TOPICS[: args.system_prompts]]
    asked = random.Random(questions_seed)
    return [
        (
            systems[i % len(systems)],
            [
                f"Question {turn + 1} of conversation {i}: tell me something about item {asked.randrange(10_000)}."
                for turn in range(args.turns)
            ],
        )
        for i in range(args.conversations)
    ]


HITS, QUERIES, GENERATED = COUNTERS = (
    "shoal:prefix_cache_hits_total",
    "shoal:prefix_cache_queries_total",
    "shoal:generation_tokens_total",
)


async def run_conversations(router_url: str, conversations, args) -> dict:
    gate = asyncio.Semaphore(args.concurrency)
    ttfts: list[float] = []
    tokens = 0

    async def converse(client: httpx.AsyncClient, system: str, questions: list[str]) -> None:
        nonlocal tokens
        messages = [{"role": "system", "content": system}]
        for question in questions:
            messages.append({"role": "user", "content": question})
            body = {
                "model": "bench",
                "messages": messages,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            async with gate:
                started, first, reply = time.perf_counter(), None, []
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        choice = json.loads(line[6:])["choices"][0]
                        content = choice.get("delta", {}).get("content") or ""
                        if choice.get("token_ids") or content:  # a llama.cpp server sends no token ids
                            first = first or time.perf_counter()
                            tokens += len(choice.get("token_ids") or [content])
                        reply.append(content)
                ttfts.append(first - started)
            messages.append({"role": "assistant", "content": "".join(reply)})

    started = time.perf_counter()
    async with httpx.AsyncClient(
        base_url=router_url, timeout=600, limits=httpx.Limits(max_connections=args.concurrency + 4)
    ) as client:
        await asyncio.gather(*(converse(client, s, q) for s, q in conversations))
    seconds = time.perf_counter() - started
    ordered = sorted(ttfts)
    return {
        "requests": len(ttfts),
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "ttft_p50_s": ordered[len(ordered) // 2],
        "ttft_p99_s": ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))],
    }


def router_command(name: str, port: int, urls: list[str]) -> tuple[list[str], str]:
    """The command of router NAME (`POLICY` for shoal's, `PEER:POLICY` for a peer's) and the path
    that answers once it is ready."""
    peer, _, policy = name.rpartition(":")
    if not peer:
        policy, _, index = policy.partition("@")
        config = []
        if index == "guessed":  # the router guesses what each worker caches instead of following its events
            with tempfile.NamedTemporaryFile("w", suffix=".yaml", delete=False) as file:
                file.write("follow_kv_events: false\n")
            config = ["--config", file.name]
        return [sys.executable, "-m", "shoal.cli", "router", "--port", str(port), "--policy", policy, *config] + [
            arg for url in urls for arg in ("--worker", url)
        ], "/ready"
    program = str(peer_program(peer, print))
    metrics = ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    common = ["--worker-urls", *urls, "--host", "127.0.0.1", "--port", str(port), "--policy", policy, *metrics]
    return ([program, "launch", *common] if peer == "smg" else [program, *common]), "/health"


def measure(policy: str, args) -> dict:
    env = {**os.environ}
    workers, urls = [], []
    try:
        shoal_workers = args.workers - args.llama_cpp_workers
        for index in range(args.workers):
            port = free_port()
            urls.append(f"http://127.0.0.1:{port}")
            if index >= shoal_workers:
                command = llama_server_command(python_of("llama-cpp", print), gguf_of(args.model), "bench", port)
                workers.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                continue
            slow = ["--step-delay-ms", str(args.slow_step_ms)] if index < args.slow_workers else []
            command = [
                sys.executable,
                "-m",
                "shoal.cli",
                "worker",
                "--model",
                args.model,
                "--port",
                str(port),
                "--served-model-name",
                "bench",
                "--kv-cache",
                args.kv_cache,
                "--num-threads",
                str(args.threads_per_worker),
                *slow,
            ]
            workers.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for index, (process, url) in enumerate(zip(workers, urls)):
            wait_for(url + ("/ready" if index < shoal_workers else "/v1/models"), process)
        port = free_port()
        command, ready_path = router_command(policy, port, urls)
        workers.append(subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        router_url = f"http://127.0.0.1:{port}"
        wait_for(router_url + ready_path, workers[-1])
        if args.warmup:  # the system prompts placed by this router, and the first calls made
            asyncio.run(run_conversations(router_url, make_conversations(args, args.seed + 1000), args))
        counted = urls[:shoal_workers]  # the llama.cpp servers have no such counters
        before = [worker_counters(url, COUNTERS) for url in counted]
        result = asyncio.run(run_conversations(router_url, make_conversations(args, args.seed), args))
        after = [worker_counters(url, COUNTERS) for url in counted]
        during = [{k: end[k] - start[k] for k in COUNTERS} for start, end in zip(before, after)]
        hits, queries, generated = (sum(w[k] for w in during) for k in (HITS, QUERIES, GENERATED))
        result["prefix_hit_rate"] = hits / max(1.0, queries)
        # Each worker's share of the tokens generated (slow workers first, with --slow-workers).
        result["token_shares"] = [round(w[GENERATED] / max(1.0, generated), 3) for w in during]
        # What the client got that no shoal worker generated: the llama.cpp servers' part.
        result["llama_cpp_token_share"] = round(max(0.0, 1 - generated / max(1, result["tokens"])), 3)
        speeds = ("prefill_tokens_per_s", "decode_tokens_per_s", "decode_step_s", "capability")
        result["worker_speeds_at_end"] = [{k: httpx.get(u + "/load").json()[k] for k in speeds} for u in counted]
        return result
    finally:
        for process in workers:
            process.terminate()
        for process in workers:
            process.wait(timeout=60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--kv-cache", default="256MiB")
    parser.add_argument("--policies", default="cost,round_robin")
    parser.add_argument(
        "--slow-workers", type=int, default=0, help="of the workers, this many take at least --slow-step-ms a step"
    )
    parser.add_argument("--slow-step-ms", type=int, default=60, help="a slow worker's least step time")
    parser.add_argument(
        "--llama-cpp-workers", type=int, default=0, help="of the workers, the last this many are llama.cpp servers"
    )
    parser.add_argument("--system-prompts", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="first a run of other conversations over the same system prompts, not measured",
    )
    parser.add_argument("--repeats", type=int, default=1, help="runs of each policy, interleaved; medians reported")
    args = parser.parse_args()
    policies = args.policies.split(",")
    runs: dict[str, list[dict]] = {policy: [] for policy in policies}
    for repeat in range(args.repeats):
        for policy in policies[repeat % len(policies) :] + policies[: repeat % len(policies)]:
            r = measure(policy, args)
            runs[policy].append(r)
            print(
                f"{policy:>24}: hit rate {r['prefix_hit_rate']:.3f}, TTFT p50 {r['ttft_p50_s'] * 1e3:.0f} ms "
                f"p99 {r['ttft_p99_s'] * 1e3:.0f} ms, {r['tokens_per_s']:.1f} tok/s ({r['seconds']:.1f} s), "
                f"token shares {r['token_shares']}"
                + (f", llama.cpp {r['llama_cpp_token_share']}" if args.llama_cpp_workers else ""),
                flush=True,
            )
    keys = ("prefix_hit_rate", "ttft_p50_s", "ttft_p99_s", "tokens_per_s", "seconds")
    results = {
        policy: {key: statistics.median(r[key] for r in measured) for key in keys} for policy, measured in runs.items()
    }
    if args.repeats > 1:
        print(f"medians of {args.repeats} runs ({cpu_description()}):")
        for policy, r in results.items():
            print(
                f"{policy:>24}: hit rate {r['prefix_hit_rate']:.3f}, TTFT p50 {r['ttft_p50_s'] * 1e3:.0f} ms "
                f"p99 {r['ttft_p99_s'] * 1e3:.0f} ms, {r['tokens_per_s']:.1f} tok/s, wall {r['seconds']:.1f} s"
            )
    if "round_robin" in results and policies[0] != "round_robin":
        base, rr = results[policies[0]], results["round_robin"]
        print(
            f"{policies[0]} / round_robin: hit rate x{base['prefix_hit_rate'] / max(rr['prefix_hit_rate'], 1e-9):.2f}, "
            f"TTFT p99 x{base['ttft_p99_s'] / rr['ttft_p99_s']:.2f}, tok/s x{base['tokens_per_s'] / rr['tokens_per_s']:.2f}"
        )
    RESULTS.mkdir(exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = RESULTS / f"routing-quality-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    record = {"args": vars(args), "commit": commit, "cpu": cpu_description(), "results": results, "runs": runs}
    out.write_text(json.dumps(record, indent=2))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
