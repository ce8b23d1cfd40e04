"""A program that runs the tiny engine under this process's SHOAL_CPU_ISA and prints what it ran on.

    python -m tests.support.engine_under_isa_cap MODEL_DIR MOE_DIR LORA_DIR CACHE_DIR DTYPE...

The cap is applied before torch runs anything, as the CLI does. The last line of stdout is a JSON
report: the effective level, what torch's libraries say about themselves, the compiler flags of the
CPU kernels loaded here, per dtype the GEMM backend of packed and of shared weights and whether
requests run alone and together got the same tokens (and the same again when each is handed its
own output as a prediction: speculative drafts scored in multi-token chunks, kept; and when half of
them run LORA_DIR's adapter, through the LoRA kernel), and the native
matrix multiply's bitwise row
check (tests.support.linear_rows_check) on this level's kernel path, with a digest of its quantized
blocks against bfloat16 x; and for a mixture of experts (MOE_DIR, in bfloat16) whether its requests run
alone and together got the same tokens, on its native experts kernel.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

REPORT_PREFIX = "ENGINE_UNDER_ISA_CAP "


def loaded_kernel_build_flags() -> str:
    """The cflags in build.ninja beside the CPU kernels library mapped into this process."""
    with open("/proc/self/maps") as maps:
        libraries = {line.split()[-1] for line in maps if line.rstrip().endswith("shoal_cpu_kernels.so")}
    if len(libraries) != 1:
        return ""
    build = (Path(libraries.pop()).parent / "build.ninja").read_text()
    return next((line for line in build.splitlines() if line.startswith("cflags")), "")


def main(model_dir: str, moe_dir: str, lora_dir: str, cache_dir: str, dtypes: list[str]) -> dict:
    from shoal.model.cpu_features import apply_cpu_isa_cap

    features = apply_cpu_isa_cap()

    import torch

    from shoal.config.engine import EngineConfig
    from shoal.engine.engine import LLMEngine
    from shoal.engine.sampling_params import SamplingParams
    from shoal.runner.devices import resolve_dtype
    from tests.support.engine_runs import run_to_completion
    from tests.support.linear_rows_check import bf16_pairs_digest, check

    def engine(dtype: str, share_weights: bool = False, model: str = model_dir, **lora) -> LLMEngine:
        # One thread: on a busy machine two threads wait on each other at every tiny multiply.
        return LLMEngine(
            EngineConfig(
                model=model,
                dtype=dtype,
                device="cpu",
                kv_cache_bytes=4 << 20,
                block_size=4,
                max_num_batched_tokens=64,
                cache_dir=cache_dir,
                num_threads=1,
                share_weights=share_weights,
                **lora,
            )
        )

    params = SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)
    prompts = {f"p{i}": ([4 + i] * (3 + 5 * i), params) for i in range(5)}
    runs = {}
    for dtype in dtypes:
        together_engine, alone_engine = engine(dtype), engine(dtype)
        together = run_to_completion(together_engine, prompts)
        alone = {key: run_to_completion(alone_engine, {key: request})[key] for key, request in prompts.items()}
        speculating = engine(dtype)
        predicted = {
            key: (prompt, dataclasses.replace(request_params, predicted_token_ids=tuple(alone[key])))
            for key, (prompt, request_params) in prompts.items()
        }
        adapted = dict(enable_lora=True, max_loras=2, lora_modules=(f"a={lora_dir}",))
        with_lora = {key: (*request, "a" if i % 2 else None) for i, (key, request) in enumerate(prompts.items())}
        lora_together = run_to_completion(engine(dtype, **adapted), with_lora)
        lora_alone = {
            key: run_to_completion(engine(dtype, **adapted), {key: request})[key] for key, request in with_lora.items()
        }
        # Shared weights run on torch's kernels (oneDNN where it has them): the cap must reach those too.
        shared = engine(dtype, share_weights=True)
        runs[dtype] = {
            "backend": together_engine.model.layers[0].qkv.description,
            "shared_backend": shared.model.layers[0].qkv.description,
            "shared_distinct_outputs": len({tuple(t) for t in run_to_completion(shared, prompts).values()})
            if dtype == "float32"
            else None,
            "invariant": alone == together,
            "speculation_keeps_tokens": run_to_completion(speculating, predicted) == alone,
            "drafts_kept": speculating.speculation.accepted_draft_tokens,
            "lora_invariant": lora_alone == lora_together,
            "lora_changes_tokens": all(lora_together[key] != alone[key] for key in list(prompts)[1::2]),
            "lora_keeps_the_base": all(lora_together[key] == alone[key] for key in list(prompts)[::2]),
            "distinct_outputs": len({tuple(tokens) for tokens in together.values()}),
            "attention_uses_tiles": together_engine.model.attention_uses_tiles,
        }
    moe_together, moe_alone = engine("bfloat16", model=moe_dir), engine("bfloat16", model=moe_dir)
    together = run_to_completion(moe_together, prompts)
    alone = {key: run_to_completion(moe_alone, {key: request})[key] for key, request in prompts.items()}
    moe = {
        "invariant": alone == together,
        "distinct_outputs": len({tuple(tokens) for tokens in together.values()}),
        "native_experts": all(
            layer.experts.kernel is not None for layer in moe_together.model.layers if layer.experts is not None
        ),
    }
    return {
        "level": features.level.name,
        "capped": features.capped,
        "features": {
            "native_bf16": features.native_bf16,
            "onednn_bf16": features.onednn_bf16,
            "onednn_fp16": features.onednn_fp16,
        },
        "torch": {
            "aten": torch.backends.cpu.get_cpu_capability(),
            "onednn_bf16": torch.ops.mkldnn._is_mkldnn_bf16_supported(),
            "onednn_fp16": torch.ops.mkldnn._is_mkldnn_fp16_supported(),
        },
        "auto_dtype": str(resolve_dtype(EngineConfig(model=model_dir, dtype="auto"), torch.device("cpu"))),
        "kernel_cflags": loaded_kernel_build_flags(),
        "runs": runs,
        "moe": moe,
        "linear_rows": check(),
        "bf16_pairs_digest": bf16_pairs_digest(),
    }


if __name__ == "__main__":
    print(
        REPORT_PREFIX + json.dumps(main(sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5:])), flush=True
    )
