"""Expert parallelism against tensor parallelism's split of each expert, for a mixture of experts on
one host: generation and end-to-end throughput at each concurrency, for two ranks holding half of
every expert's columns (TP=2), two ranks holding half of the experts whole (TP=2 with
--enable-expert-parallel), and one process. Every configuration gets the same cores: the single
process all of them, each rank half. All three give the same tokens (checked: the first request's).

The model is gguf_quant_speed's qwen3-moe-0.9b (32 experts, top-8, random weights) as llama.cpp
quantizes it (Q4_K_M by default; made on first use).

    .venv/bin/python benchmarks/expert_parallel.py [--type Q4_K_M] [--concurrency 1,32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from cpu_name import cpu_description
from gguf_quant_speed import MEDIANS, REPO, log, model_files, shoal_once
from measurement import measured

CONFIGURATIONS = {
    "one process": {},
    "TP=2 (expert columns)": {"tensor_parallel_size": 2},
    "TP=2 + EP (whole experts)": {"tensor_parallel_size": 2, "enable_expert_parallel": True},
}


def engine(gguf: Path, options: dict[str, Any], args: argparse.Namespace, warm: list[list[int]]) -> Any:
    from shoal import LLM

    ranks = options.get("tensor_parallel_size", 1)
    llm = LLM(
        str(gguf),
        dtype=args.dtype,
        device="cpu",
        kv_cache_bytes=256 << 20,
        num_threads=max(1, args.threads // ranks),
        enable_prefix_caching=False,
        **options,
    )
    shoal_once(llm, warm, 8, "warm")
    return llm


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--type", default="Q4_K_M")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", default="1,32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--retries", type=int, default=2)
    parser.add_argument("--noise-threshold", type=float, default=0.3, help="other processes' cores")
    parser.add_argument("--wait-idle", type=float, default=60.0, help="seconds to wait for an idle CPU")
    parser.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args()

    gguf = model_files("qwen3-moe-0.9b", [args.type], args.threads)[args.type]
    levels = [int(c) for c in args.concurrency.split(",")]
    rng = random.Random(9)
    asked = {c: [[rng.randrange(3, 49152) for _ in range(args.prompt_tokens)] for _ in range(c)] for c in levels}
    warm = [[rng.randrange(3, 49152) for _ in range(args.prompt_tokens)] for _ in range(2)]
    cpu = cpu_description()
    log(f"CPU: {cpu}; qwen3-moe-0.9b {args.type}; {args.threads} threads in all; c={args.concurrency}")
    results: dict[str, Any] = {"cpu": cpu, "args": vars(args), "runs": {}}
    runs: dict[tuple[str, int], list[dict[str, Any]]] = {(name, c): [] for name in CONFIGURATIONS for c in levels}
    for repeat in range(args.repeats):  # each configuration in turn, so a slow spell hits all of them
        for name, options in CONFIGURATIONS.items():
            llm = engine(gguf, options, args, warm)
            try:
                for c in levels:
                    tag = f"{len(runs[(name, c)])}-{c}-{repeat}"
                    metrics, tokens = measured(
                        name,
                        lambda attempt, c=c, tag=tag: shoal_once(llm, asked[c], args.new_tokens, f"{tag}-{attempt}"),
                        args,
                        log,
                    )
                    runs[(name, c)].append({**metrics, "tokens": tokens})
            finally:
                llm.shutdown()
    for c in levels:
        base = None
        for name in CONFIGURATIONS:
            cell = runs[(name, c)]
            median = {key: statistics.median(m[key] for m in cell) for key in MEDIANS}
            base = base or median
            same = cell[0]["tokens"] == runs[("one process", c)][0]["tokens"]
            log(
                f"c={c:<3d} {name:26s} e2e {median['end_to_end_tok_s']:7.2f} tok/s "
                f"({median['end_to_end_tok_s'] / base['end_to_end_tok_s']:4.2f}x)  gen {median['gen_tok_s']:7.2f} "
                f"tok/s ({median['gen_tok_s'] / base['gen_tok_s']:4.2f}x)  ITL p50 {median['itl_ms_p50']:6.2f} ms  "
                f"tokens as one process's: {same}  (medians of {args.repeats})"
            )
            results["runs"][f"{name} c={c}"] = {"median": median, "runs": cell}
    out = Path(args.out_dir) / f"expert-parallel-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps(results, indent=1))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
