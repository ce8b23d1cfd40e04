"""LoRA under tensor parallelism: each rank holds its part of every adapter (B's rows as the
projection's own rows; A whole) and rank 0 tells the followers each adapter a batch runs before it
runs it, so TP=2 gives the single process's tokens for a batch mixing adapters and the base model,
greedy and seeded, in float32 and bfloat16, for adapters given at start, loaded at run time, and a
name loaded again from other files."""

from __future__ import annotations

import pytest

from shoal.config.engine import EngineConfig
from shoal.engine.engine import LLMEngine
from shoal.engine.sampling_params import SamplingParams
from tests.support.engine_runs import run_to_completion
from tests.support.lora_adapters import write_adapter

PROMPTS = [[5, 17, 42, 8, 99], [3, 14, 15, 92, 65, 35, 89, 79], [27, 18, 28], [61, 7, 30, 12, 77, 44]]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("tp-adapters")
    for name, rank in (("a0", 8), ("a1", 4), ("a2", 8)):
        write_adapter(tiny_model_dir, root / name, rank=rank, alpha=2 * rank + len(name))
    return root


def engine(tiny_model_dir, cache_dir, adapters, dtype: str, size: int) -> LLMEngine:
    config = EngineConfig(
        model=str(tiny_model_dir),
        dtype=dtype,
        device="cpu",
        kv_cache_bytes=8 << 20,
        cache_dir=str(cache_dir),
        tensor_parallel_size=size,
        enable_lora=True,
        max_loras=3,
        lora_modules=(f"a0={adapters / 'a0'}", f"a1={adapters / 'a1'}"),
        lora_dir=str(adapters),
    )
    return LLMEngine(config)


def mixed(names: list[str | None]) -> dict[str, tuple]:
    """Eight requests: each prompt greedy and seeded, the i-th naming names[i % len(names)]."""
    requests = {}
    for i in range(8):
        params = SamplingParams(temperature=0.0 if i % 2 else 0.9, seed=i, max_tokens=10, ignore_eos=True)
        requests[f"r{i}"] = (PROMPTS[i % len(PROMPTS)], params, names[i % len(names)])
    return requests


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tp2_gives_the_single_process_tokens_with_adapters(dtype, tiny_model_dir, shoal_cache_dir, adapters):
    runs = {}
    for size in (1, 2):
        llm = engine(tiny_model_dir, shoal_cache_dir, adapters, dtype, size)
        try:
            base = run_to_completion(llm, mixed([None]))
            given = run_to_completion(llm, mixed(["a0", None, "a1", "a0", None]))
            llm.load_lora_adapter("a2", str(adapters / "a2"))
            loaded = run_to_completion(llm, mixed(["a2", "a1", None]))
            llm.unload_lora_adapter("a1")
            llm.load_lora_adapter("a1", str(adapters / "a2"))  # the name, other files: a2's tokens
            again = run_to_completion(llm, mixed(["a1", "a0"]))
        finally:
            llm.shutdown()
        runs[size] = (base, given, loaded, again)
    assert runs[2] == runs[1]
    base, given, loaded, again = runs[1]
    assert given["r0"] != base["r0"] and given["r2"] != base["r2"] and given["r1"] == base["r1"]
    assert again["r0"] == loaded["r0"]  # "a1" now runs a2's files
