"""The CPU attention kernel alone: one decoding step's 30 attention calls (SmolLM2's shapes: 9 query
heads over 3 KV heads of 64, bfloat16 cache) for 64 sequences at a context length, against a plain
read of the same cache bytes.

Each of the 30 layers has a cache of its own, so a step reads every key and value from memory as a
real step does ("from memory"); `--hot` reuses one layer's cache 30 times (it stays in L3), which
shows the kernel's compute alone. Median of 15 steps. Usage:

    .venv/bin/python benchmarks/attention_kernel.py [--context 100] [--sequences 64] [--hot]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from shoal.model.native_kernels import load_native_kernels
from shoal.model.paged_attention import allocate_kv_cache, build_attention_metadata

LAYERS, BLOCK, KV_HEADS, GROUP, HEAD_DIM = 30, 16, 3, 3, 64


def median_ms(fn, repeats: int = 15) -> float:
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=100)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--hot", action="store_true", help="one layer's cache for every call")
    args = parser.parse_args()
    kernels = load_native_kernels()
    if kernels is None:
        raise SystemExit("the native kernels do not build here")
    blocks_per_sequence = -(-args.context // BLOCK)
    caches = []
    for _ in range(1 if args.hot else LAYERS):
        keys, values = allocate_kv_cache(
            args.sequences * blocks_per_sequence, KV_HEADS, BLOCK, HEAD_DIM, torch.bfloat16, torch.device("cpu")
        )
        keys.normal_()
        values[..., :HEAD_DIM].normal_()
        caches.append((keys, values))
    tables = [list(range(s * blocks_per_sequence, (s + 1) * blocks_per_sequence)) for s in range(args.sequences)]
    [meta] = build_attention_metadata(
        [1] * args.sequences,
        [args.context - 1] * args.sequences,
        [tables],
        BLOCK,
        KV_HEADS,
        GROUP,
        8,
        torch.device("cpu"),
        windows=(0,),
        with_tiles=False,
    )
    q = torch.randn(args.sequences, KV_HEADS * GROUP, HEAD_DIM)
    calls = caches * (LAYERS if args.hot else 1)

    def step() -> None:
        for keys, values in calls:
            kernels.paged_attention_rows(
                q, keys, values, meta.block_tables, meta.token_sequences, meta.token_positions, HEAD_DIM**-0.5, 0, 0.0
            )

    def read() -> None:
        for keys, values in calls:
            keys.view(torch.int16).max()
            values.view(torch.int16).max()

    megabytes = sum(k.numel() * 2 + v.numel() * 2 for k, v in calls) / 1e6
    where = "one layer's cache, hot" if args.hot else "from memory"
    print(f"{args.sequences} sequences at {args.context} tokens, {LAYERS} layers ({where}, {megabytes:.0f} MB read):")
    print(f"  attention {median_ms(step):.2f} ms a step; a plain read of the same bytes {median_ms(read):.2f} ms")


if __name__ == "__main__":
    main()
