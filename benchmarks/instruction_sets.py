"""Engine tokens/s at each instruction-set level this CPU allows (SHOAL_CPU_ISA), per dtype.

Each (level, dtype) runs in a fresh process, where the cap reaches torch's libraries before their
first use. The model is SmolLM2-135M-Instruct; every request has its own 32-token prompt and
generates --new-tokens greedily with ignore_eos. tokens/s = generated tokens / wall time of the
run (prefill included), best of --repeats after one warm-up run.

Usage:
    .venv/bin/python benchmarks/instruction_sets.py                    # every level and dtype
    .venv/bin/python benchmarks/instruction_sets.py --levels avx2,amx --dtypes bfloat16

Prints a markdown table and writes benchmarks/results/instruction-sets-<timestamp>.json.
Not a test: pytest only collects tests/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULT_PREFIX = "INSTRUCTION_SET_RESULT "


def measure(dtype: str, concurrencies: list[int], new_tokens: int, repeats: int, threads: int) -> dict:
    """In this process, under its SHOAL_CPU_ISA: tokens/s per concurrency, and the GEMM backend used."""
    from shoal.model.cpu_features import apply_cpu_isa_cap

    features = apply_cpu_isa_cap()

    from shoal.config.engine import EngineConfig
    from shoal.engine.engine import LLMEngine
    from shoal.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(dtype=dtype, device="cpu", kv_cache_bytes=512 << 20, num_threads=threads))
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    serial = iter(range(1 << 30))

    def run(concurrency: int) -> float:
        for _ in range(concurrency):
            n = next(serial)
            engine.add_request(f"r{n}", [100 + (n * 7 + i) % 20000 for i in range(32)], params)
        start = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
        return concurrency * new_tokens / (time.perf_counter() - start)

    rates = {}
    for concurrency in concurrencies:
        run(concurrency)
        rates[concurrency] = max(run(concurrency) for _ in range(repeats))
    projection = engine.model.layers[0].qkv
    return {
        "level": features.level.name,
        "dtype": dtype,
        "tokens_per_s": rates,
        "backend": f"{projection.backend} {str(projection.compute_dtype).removeprefix('torch.')}",
    }


def main() -> None:
    from shoal.model.cpu_features import LEVEL_NAMES, effective_cpu_features

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--levels", default=None, help="comma-separated levels (default: avx2 up to this CPU's)")
    p.add_argument("--dtypes", default="bfloat16,float16,float32")
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--child", nargs=1, metavar="DTYPE", help=argparse.SUPPRESS)
    args = p.parse_args()
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    if args.child:
        result = measure(args.child[0], concurrencies, args.new_tokens, args.repeats, args.threads)
        print(RESULT_PREFIX + json.dumps(result), flush=True)
        return
    host = effective_cpu_features().host_level.name
    levels = args.levels.split(",") if args.levels else list(LEVEL_NAMES[1 : LEVEL_NAMES.index(host) + 1])
    results = []
    for level in levels:
        for dtype in args.dtypes.split(","):
            command = [
                sys.executable,
                __file__,
                "--child",
                dtype,
                "--concurrency",
                args.concurrency,
                "--new-tokens",
                str(args.new_tokens),
                "--repeats",
                str(args.repeats),
                "--threads",
                str(args.threads),
            ]
            done = subprocess.run(
                command, env={**os.environ, "SHOAL_CPU_ISA": level}, capture_output=True, text=True, check=False
            )
            line = next((line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)), None)
            if line is None:
                sys.exit(f"{level} {dtype} failed:\n{done.stderr[-3000:]}")
            results.append(json.loads(line.removeprefix(RESULT_PREFIX)))
            print(f"{level:12} {dtype:9} {results[-1]}", flush=True)
    header = " | ".join(f"c={c} tok/s" for c in concurrencies)
    print(f"\n| level | dtype | GEMM | {header} |\n|---|---|---|" + "---:|" * len(concurrencies))
    for r in results:
        rates = " | ".join(
            f"{r['tokens_per_s'][str(c)] if str(c) in r['tokens_per_s'] else r['tokens_per_s'][c]:.1f}"
            for c in concurrencies
        )
        print(f"| {r['level']} | {r['dtype']} | {r['backend']} | {rates} |")
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    (out / f"instruction-sets-{stamp}.json").write_text(json.dumps({"host_level": host, "results": results}, indent=1))


if __name__ == "__main__":
    main()
