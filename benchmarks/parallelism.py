"""Model parallelism on one host: what pipeline and tensor parallelism cost or gain against one process.

- PP=2 vs PP=1: generation throughput with 32 requests in flight (64 tokens each), and the
  pipeline's bubble fraction: 1 - (seconds each stage computed, summed) / (stages x wall time).
- TP=2 vs TP=1: single-stream latency (ms per generated token).
- Bytes on the wire per token between pipeline stages, in the model's dtype and in 16 bits.

Every configuration gets the same cores: the single process uses all of them, each of the two
processes of a PP=2 or TP=2 replica half. SmolLM2-135M-Instruct in float32 unless --dtype.

    .venv/bin/python benchmarks/parallelism.py [--dtype float32] [--threads 2] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import json
import time

from routing_quality import RESULTS

from shoal.engine.sampling_params import SamplingParams
from shoal.llm import LLM

MODEL = "smollm2-135m-instruct"
PROMPTS = [
    "Tell me about the sea.",
    "Write a poem about autumn.",
    "Explain gravity to a child.",
    "What is a good breakfast?",
    "Describe a city at night.",
    "How do birds fly?",
    "Why is the sky blue?",
    "Give me three tips for sleep.",
]


def throughput(llm: LLM, concurrency: int, tokens: int) -> float:
    prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(concurrency)]
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4))  # warm-up
    started = time.perf_counter()
    outputs = llm.generate(prompts, params)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - started)


def pipeline_run(args, wire_dtype: str) -> dict:
    llm = LLM(
        MODEL,
        dtype=args.dtype,
        kv_cache_bytes=256 << 20,
        pipeline_parallel_size=2,
        num_threads=max(1, args.threads // 2),
        pipeline_wire_dtype=wire_dtype,
    )
    runner = llm.engine.runner
    try:
        busy_before, started = runner.stage_busy_seconds(), time.perf_counter()
        rate = throughput(llm, args.concurrency, args.tokens)
        wall = time.perf_counter() - started
        busy = [after - before for after, before in zip(runner.stage_busy_seconds(), busy_before)]
        return {
            "tokens_per_s": rate,
            "bubble_fraction": 1 - sum(busy) / (len(busy) * wall),
            "stage_busy_s": busy,
            "wire_bytes_per_token": runner.wire_bytes / runner.wire_tokens,
        }
    finally:
        llm.shutdown()


def single_stream_ms(llm: LLM, tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    llm.generate(PROMPTS[0], SamplingParams(max_tokens=4))
    started = time.perf_counter()
    output = llm.generate(PROMPTS[0], params)[0]
    return (time.perf_counter() - started) * 1e3 / len(output.outputs[0].token_ids)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    single = LLM(MODEL, dtype=args.dtype, kv_cache_bytes=256 << 20, num_threads=args.threads)
    pp1 = throughput(single, args.concurrency, args.tokens)
    tp1_ms = single_stream_ms(single, args.tokens)
    single.shutdown()
    pp2 = pipeline_run(args, "auto")
    pp2_16 = pipeline_run(args, "bfloat16") if args.dtype == "float32" else None
    tensor = LLM(MODEL, dtype=args.dtype, kv_cache_bytes=256 << 20, tensor_parallel_size=2)
    tp2_ms = single_stream_ms(tensor, args.tokens)
    tensor.shutdown()
    result = {
        "dtype": args.dtype,
        "threads": args.threads,
        "concurrency": args.concurrency,
        "pp1_tokens_per_s": pp1,
        "pp2": pp2,
        "pp2_bfloat16_wire": pp2_16,
        "pp2_over_pp1": pp2["tokens_per_s"] / pp1,
        "tp1_ms_per_token": tp1_ms,
        "tp2_ms_per_token": tp2_ms,
        "tp2_over_tp1_latency": tp2_ms / tp1_ms,
    }
    print(json.dumps(result, indent=2))
    (RESULTS / "parallelism.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
