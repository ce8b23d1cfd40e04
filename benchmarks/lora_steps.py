"""Where a LoRA step's time goes, offline: the deltas of one decode step (every projection of every
layer, `--rows` rows over `--adapters` random rank-`--rank` adapters, `LoraBatch.deltas` alone), and
the median decode step of an engine serving the same requests with and without the adapters.

    .venv/bin/python benchmarks/lora_steps.py [--adapters 8] [--rank 16] [--rows 32]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from cpu_name import cpu_description
from lora_throughput import PROMPT, write_random_adapter

from shoal.config.engine import EngineConfig
from shoal.engine.engine import LLMEngine
from shoal.engine.sampling_params import SamplingParams
from shoal.model.inspection import inspect_model
from shoal.model.lora_adapter import load_peft_adapter
from shoal.model.lora_batch import FUSED_TARGETS, LoraBatch, PackedAdapter
from shoal.model.sharding import projection_widths


def deltas_ms(config, directories: list[Path], args) -> float:
    """Median milliseconds of one step's deltas (bfloat16 adapters and inputs, the model's threads)."""
    packed = [
        PackedAdapter(load_peft_adapter(d.name, d, config, args.rank), torch.bfloat16, torch.device("cpu"), 16, True)
        for d in directories
    ]
    rows = [packed[i % len(packed)] for i in range(args.rows)]
    batch = LoraBatch.of_rows(rows, projection_widths(config, None), torch.device("cpu"))
    inputs = {
        "qkv": torch.randn(args.rows, config.hidden_size).bfloat16(),
        "o_proj": torch.randn(args.rows, config.num_heads * config.head_dim).bfloat16(),
        "gate_up": torch.randn(args.rows, config.hidden_size).bfloat16(),
        "down_proj": torch.randn(args.rows, config.intermediate_size).bfloat16(),
    }
    assert set(inputs) == {*FUSED_TARGETS, "o_proj", "down_proj"}
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        for layer in range(config.num_layers):
            for projection, x in inputs.items():
                batch.deltas(layer, projection, x)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times[1:])


def step_ms(args, modules: tuple[str, ...]) -> float:
    """The median decode step of `args.rows` requests (64 tokens each), each naming an adapter in turn."""
    names = [module.split("=")[0] for module in modules]
    config = EngineConfig(
        model=args.model,
        enable_lora=bool(modules),
        max_loras=max(1, len(modules)),
        max_lora_rank=args.rank,
        lora_modules=modules,
    )
    engine = LLMEngine(config)
    prompt = engine.tokenizer.encode(PROMPT)
    try:
        steps = []
        for round_ in range(2):
            for i in range(args.rows):
                params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
                engine.add_request(f"{round_}-{i}", prompt, params, lora=names[i % len(names)] if names else None)
            while engine.has_unfinished_requests():
                started = time.perf_counter()
                engine.step()
                if round_:
                    steps.append(time.perf_counter() - started)
        return 1000 * statistics.median(steps)
    finally:
        engine.shutdown()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--rows", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=11)
    args = parser.parse_args()
    config = inspect_model(args.model).config
    work = Path(tempfile.mkdtemp(prefix="shoal-lora-steps-"))
    directories = [work / f"a{i}" for i in range(args.adapters)]
    for seed, directory in enumerate(directories):
        write_random_adapter(directory, config, args.rank, seed)
    print(cpu_description())
    print(
        f"a step's deltas ({args.rows} rows, {args.adapters} adapters): {deltas_ms(config, directories, args):.2f} ms"
    )
    base = step_ms(args, ())
    adapted = step_ms(args, tuple(f"{d.name}={d}" for d in directories))
    print(f"decode step: base {base:.2f} ms, with adapters {adapted:.2f} ms ({base / adapted:.2f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
