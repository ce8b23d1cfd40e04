"""LoRA adapters mixed in one batch, through the worker's HTTP server: the same concurrent completions
to a worker serving the base model alone, and to one serving `--adapters` random adapters (every
q/k/v/o/gate/up/down projection, rank `--rank`, PEFT files written here) with each request naming
one of them in turn. Reported: output tokens per second of each and the ratio (the issue's target:
8 adapters at c=32 reach 0.8x the base model's throughput).

    .venv/bin/python benchmarks/lora_throughput.py [--adapters 8] [--rank 16] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
from cpu_name import cpu_description
from safetensors.torch import save_file
from speculative import shoal_worker, start

from shoal.model.inspection import inspect_model
from shoal.model.lora_adapter import LORA_TARGETS, projection_shape

RESULTS = Path(__file__).parent / "results"
PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def write_random_adapter(directory: Path, config, rank: int, seed: int) -> None:
    """A PEFT LoRA adapter of random weights on every projection of every layer."""
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target in LORA_TARGETS:
            out, into = projection_shape(config, target)
            block = "self_attn" if target in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, into, generator=generator) * 0.02
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.02
    directory.mkdir(parents=True)
    save_file(tensors, directory / "adapter_model.safetensors")
    settings = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(LORA_TARGETS)}
    (directory / "adapter_config.json").write_text(json.dumps(settings))


async def run(url: str, models: list[str], concurrency: int, max_tokens: int) -> float:
    """Output tokens a second of `concurrency` greedy completions at once, the i-th naming models[i % len]."""
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        body = {"prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        started = time.perf_counter()
        answers = await asyncio.gather(
            *(
                client.post("/v1/completions", json={**body, "model": models[i % len(models)]})
                for i in range(concurrency)
            )
        )
        seconds = time.perf_counter() - started
    for answer in answers:
        answer.raise_for_status()
    return sum(a.json()["usage"]["completion_tokens"] for a in answers) / seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="each worker's best round counts")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="shoal-lora-"))
    config = inspect_model(args.model).config
    names = [f"a{i}" for i in range(args.adapters)]
    for i, name in enumerate(names):
        write_random_adapter(work / name, config, args.rank, seed=i)
    lora = ["--enable-lora", "--max-loras", str(args.adapters), "--max-lora-rank", str(args.rank)]
    lora += ["--lora-modules", ",".join(f"{name}={work / name}" for name in names)]
    workers = {"base": ([], ["bench"]), "lora": (lora, names)}
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for kind, (flags, models) in workers.items():
            process, url = start(shoal_worker(args.model, flags), work / f"{kind}.log")
            try:
                asyncio.run(run(url, models, args.concurrency, 8))  # warm-up
                rate = asyncio.run(run(url, models, args.concurrency, args.max_tokens))
                best[kind] = max(best.get(kind, 0.0), rate)
            finally:
                process.terminate()
                process.wait(timeout=30)
    report = {
        "cpu": cpu_description(),
        "model": args.model,
        "adapters": args.adapters,
        "rank": args.rank,
        "concurrency": args.concurrency,
        "base_tokens_per_s": round(best["base"], 1),
        "lora_tokens_per_s": round(best["lora"], 1),
        "ratio": round(best["lora"] / best["base"], 2),
    }
    print(json.dumps(report), flush=True)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"lora-throughput-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(report, indent=2))
    print("->", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
