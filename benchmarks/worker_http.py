"""Throughput and latency of one worker through HTTP against the same engine in-process, and
against the engine stepped offline (`--sides http,offline`: what a served stream costs over the
offline engine's; `--concurrency 1` for one stream).

Both sides run the same workload: N streaming requests, at most C in flight, each a fixed list of
prompt token ids and a fixed number of new tokens (greedy, EOS ignored). In-process, the requests go
through AsyncLLMEngine.generate; over HTTP, a `shoal worker` subprocess serves them and this process
is the client (httpx, server-sent events). Reported per side: generated tokens/s over the whole run,
and time to first token and inter-token latency percentiles as the consumer sees them.

    .venv/bin/python benchmarks/worker_http.py [--concurrency 32] [--requests 96] [--repeats 2]
    .venv/bin/python benchmarks/worker_http.py --sides http,offline --concurrency 1 --requests 4 \
        --prompt-tokens 300 --max-tokens 256 --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from cpu_name import cpu_description

from shoal.percentile import percentiles

RESULTS = Path(__file__).parent / "results"


@dataclass
class RequestTiming:
    submitted: float
    token_times: list[float] = field(default_factory=list)


@dataclass
class RunResult:
    tokens: int
    seconds: float
    timings: list[RequestTiming]

    def summary(self) -> dict:
        ttft = [t.token_times[0] - t.submitted for t in self.timings if t.token_times]
        itl = [b - a for t in self.timings for a, b in zip(t.token_times, t.token_times[1:])]
        return {
            "tokens": self.tokens,
            "seconds": self.seconds,
            "tokens_per_s": self.tokens / self.seconds,
            "ttft_s": distribution(ttft),
            "itl_s": distribution(itl),
        }


def distribution(values: list[float]) -> dict:
    p50, p90, p99 = percentiles(values, (50, 90, 99))
    return {"p50": p50, "p90": p90, "p99": p99, "mean": statistics.fmean(values)}


def make_prompts(count: int, length: int, vocab_low: int, vocab_high: int) -> list[list[int]]:
    rng = random.Random(7)
    return [[rng.randrange(vocab_low, vocab_high) for _ in range(length)] for _ in range(count)]


async def run_workload(submit, prompts: list[list[int]], concurrency: int) -> RunResult:
    """submit(prompt, timing) streams one request, appending each token's arrival to timing."""
    gate = asyncio.Semaphore(concurrency)
    timings: list[RequestTiming] = []

    async def one(prompt: list[int]) -> None:
        async with gate:
            timing = RequestTiming(time.perf_counter())
            timings.append(timing)
            await submit(prompt, timing)

    started = time.perf_counter()
    await asyncio.gather(*(one(p) for p in prompts))
    seconds = time.perf_counter() - started
    return RunResult(sum(len(t.token_times) for t in timings), seconds, timings)


def in_process_submitter(engine, max_tokens: int):
    from shoal.engine.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)

    async def submit(prompt: list[int], timing: RequestTiming) -> None:
        async for output in engine.generate(prompt, params):
            now = time.perf_counter()
            timing.token_times.extend(now for _ in output.new_token_ids)

    return submit


def http_submitter(client: httpx.AsyncClient, model: str, max_tokens: int):
    async def submit(prompt: list[int], timing: RequestTiming) -> None:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        async with client.stream("POST", "/v1/completions", json=body) as response:
            response.raise_for_status()
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                now = time.perf_counter()
                choices = json.loads(line[6:])["choices"]
                timing.token_times.extend(now for _ in choices[0]["token_ids"])

    return submit


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure_http(args, prompts: list[list[int]]) -> dict:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "shoal.cli",
        "worker",
        "--model",
        args.model,
        "--dtype",
        args.dtype,
        "--port",
        str(port),
        "--kv-cache",
        args.kv_cache,
        "--served-model-name",
        "bench",
    ]
    worker = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/ready", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                if time.monotonic() > deadline or worker.poll() is not None:
                    raise RuntimeError("worker did not start") from None
                time.sleep(0.5)

        async def main() -> RunResult:
            limits = httpx.Limits(max_connections=args.concurrency + 8, max_keepalive_connections=args.concurrency + 8)
            async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
                submit = http_submitter(client, "bench", args.max_tokens)
                await run_workload(http_submitter(client, "bench", 8), prompts[: args.concurrency], args.concurrency)
                return await run_workload(submit, prompts, args.concurrency)

        return asyncio.run(main()).summary()
    finally:
        worker.terminate()
        worker.wait(timeout=60)


def measure_in_process(args, prompts: list[list[int]]) -> dict:
    from shoal.config.engine import EngineConfig
    from shoal.engine.startup import start_engine
    from shoal.model.weight_cache import default_cache_dir
    from shoal.sizes import parse_kv_cache

    # As the worker starts its engine: built and calibrated on the engine thread.
    config = EngineConfig(model=args.model, dtype=args.dtype, **parse_kv_cache(args.kv_cache))
    engine, _ = start_engine(config, default_cache_dir())
    try:

        async def main() -> RunResult:
            await run_workload(in_process_submitter(engine, 8), prompts[: args.concurrency], args.concurrency)
            return await run_workload(in_process_submitter(engine, args.max_tokens), prompts, args.concurrency)

        return asyncio.run(main()).summary()
    finally:
        engine.shutdown()


def measure_offline(args, prompts: list[list[int]]) -> dict:
    """The engine stepped by this process's own loop (as `LLM.generate` does), at most
    `concurrency` requests in it, the next added as one finishes; a token's time is its step's end."""
    from shoal.config.engine import EngineConfig
    from shoal.engine.calibration import calibrate
    from shoal.engine.engine import LLMEngine
    from shoal.engine.sampling_params import SamplingParams
    from shoal.sizes import parse_kv_cache

    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, **parse_kv_cache(args.kv_cache)))
    calibrate(engine)

    def run(batch: list[list[int]], max_tokens: int) -> RunResult:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        pending, timings, live = list(enumerate(batch)), {}, 0
        started = time.perf_counter()
        while pending or engine.has_unfinished_requests():
            while pending and live < args.concurrency:
                index, prompt = pending.pop(0)
                timings[str(index)] = RequestTiming(time.perf_counter())
                engine.add_request(str(index), prompt, params)
                live += 1
            outputs = engine.step()
            now = time.perf_counter()
            for output in outputs:
                timings[output.request_id].token_times.extend(now for _ in output.new_token_ids)
                live -= output.finished
        seconds = time.perf_counter() - started
        return RunResult(sum(len(t.token_times) for t in timings.values()), seconds, list(timings.values()))

    run(prompts[: args.concurrency], 8)
    return run(prompts, args.max_tokens).summary()


SIDES = {"http": measure_http, "in_process": measure_in_process, "offline": measure_offline}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--kv-cache", default="1GiB")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="rounds of the sides, alternating")
    parser.add_argument("--sides", default="http,in_process", help=f"of {','.join(SIDES)}")
    args = parser.parse_args()
    prompts = make_prompts(args.requests, args.prompt_tokens, 100, 10000)
    sides = args.sides.split(",")
    runs = []
    for repeat in range(args.repeats):
        for side in sides:
            summary = SIDES[side](args, prompts)
            runs.append({"side": side, "repeat": repeat, **summary})
            print(
                f"{side:>10} #{repeat}: {summary['tokens_per_s']:.1f} tok/s, TTFT p50 "
                f"{summary['ttft_s']['p50'] * 1e3:.0f} ms p99 {summary['ttft_s']['p99'] * 1e3:.0f} ms, ITL p50 "
                f"{summary['itl_s']['p50'] * 1e3:.1f} ms p99 {summary['itl_s']['p99'] * 1e3:.1f} ms",
                flush=True,
            )
    best = {side: max(r["tokens_per_s"] for r in runs if r["side"] == side) for side in sides}
    itl = {side: statistics.median(r["itl_s"]["p50"] for r in runs if r["side"] == side) for side in sides}
    for side in sides[1:]:
        print(
            f"{sides[0]} / {side}: tokens/s {best[sides[0]] / best[side]:.3f} (best of {args.repeats} each), "
            f"ITL p50 {itl[sides[0]] / itl[side]:.3f} (median of {args.repeats})"
        )
    print(f"CPU: {cpu_description()}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"worker-http-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "commit": commit,
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "cpu": cpu_description(),
                "runs": runs,
                "best_tokens_per_s": best,
                "median_itl_p50_s": itl,
            },
            indent=2,
        )
    )
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
