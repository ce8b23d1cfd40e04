"""shoal against llama.cpp on the same GGUF files: a model of a real shape with random weights
(transformers' config class; SmolLM2's tokenizer), converted by llama.cpp's convert_hf_to_gguf.py and
quantized by its quantizer (gguf_files.py), then tokens/s for --new-tokens greedy tokens after
--prompt-tokens-token prompts, --concurrency requests at once.

    .venv/bin/python benchmarks/gguf_quant_speed.py [--model llama-0.5b] [--types Q4_K_M,Q5_K_M]
        [--concurrency 1] [--threads 2] [--shoal-dtypes float32,auto]
    .venv/bin/python benchmarks/gguf_quant_speed.py --model qwen3-moe-0.9b --types Q4_K_M --concurrency 1,32

Models (SHAPES): llama-0.5b, a Llama of about 0.5B parameters (tied embeddings); qwen3-moe-0.9b, a
Qwen3-MoE scaled to this machine (16 layers, hidden 1024, 32 experts of 512, top-8 renormalised:
0.95B parameters, 0.34B a token).

shoal runs through its offline engine (LLM.engine: add_request for every request, then step until
done, timing each token as it comes out); llama.cpp through llama-cpp-python: one stream through its
Llama API at c=1 (llama_cpp_runs.py "single", with its CPU-setup probe), real parallel sequences
through its C API above ("batched"). Each engine is warmed up on other prompts first; the engines
take turns, --repeats times, and the medians are reported; a run that other processes disturbed
(more than --noise-threshold cores) is repeated after the CPU idles.
The files are made once under benchmarks/.peers/gguf-speed/. Writes
benchmarks/results/gguf-quant-speed-<time>.json.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from cpu_monitor import CpuMonitor  # noqa: E402
from cpu_name import cpu_description  # noqa: E402
from gguf_files import convert, quantize  # noqa: E402
from llama_cpp_peer import _run, extra_buffers_work, llama_python  # noqa: E402
from llama_cpp_runs import RESULT_PREFIX  # noqa: E402
from measurement import measured, token_metrics  # noqa: E402
from peer_venv import PEERS_DIR  # noqa: E402

WORK = PEERS_DIR / "gguf-speed"
MEDIANS = ("end_to_end_tok_s", "gen_tok_s", "ttft_ms_mean", "itl_ms_p50", "other_cores")
# (transformers config class, model class, config fields) of each model.
SHAPES = {
    "llama-0.5b": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            hidden_size=1536,
            intermediate_size=4096,
            num_hidden_layers=16,
            num_attention_heads=12,
            num_key_value_heads=4,
            head_dim=128,
            max_position_embeddings=4096,
            rope_theta=500000.0,
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
            rms_norm_eps=1e-5,
        ),
    ),
    "qwen3-moe-0.9b": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(
            hidden_size=1024,
            intermediate_size=3072,
            moe_intermediate_size=512,
            num_experts=32,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            num_hidden_layers=16,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=64,
            max_position_embeddings=4096,
            rope_theta=1000000.0,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
            rms_norm_eps=1e-6,
        ),
    ),
}


def log(message: str) -> None:
    print(message, flush=True)


def model_files(model: str, types: list[str], threads: int) -> dict[str, Path]:
    """The quantized files of `model`, made on first use: the HF directory (bfloat16; each matrix
    N(0, 1/fan_in), norms 1, so activations keep their scale and greedy tokens vary), its F16
    conversion, then each type."""
    files = {kind: WORK / f"{model}-{kind}.gguf" for kind in types}
    missing = {kind: path for kind, path in files.items() if not path.exists()}
    if not missing:
        return files
    import torch
    import transformers

    from tests.support.gguf_goldens import write_tokenizer

    hf_dir = WORK / ("hf" if model == "llama-0.5b" else f"hf-{model}")
    f16 = WORK / f"{model}-F16.gguf"
    if not f16.exists():
        if not any(hf_dir.glob("*.safetensors")):
            log(f"  building the random {model} in {hf_dir}")
            hf_dir.mkdir(parents=True, exist_ok=True)
            vocab = write_tokenizer(hf_dir, "smollm2", WORK / "tokenizers")
            torch.manual_seed(3)
            config_class, model_class, fields = SHAPES[model]
            config = getattr(transformers, config_class)(vocab_size=vocab, **fields)
            network = getattr(transformers, model_class)(config).to(torch.bfloat16)
            with torch.no_grad():
                for parameter in network.parameters():
                    if parameter.dim() == 2:
                        parameter.normal_(0, parameter.shape[1] ** -0.5)
            network.save_pretrained(hf_dir)
            del network
        log("  converting with llama.cpp's convert_hf_to_gguf.py (F16)")
        convert(hf_dir, f16, log)
    log(f"  quantizing to {', '.join(missing)} with llama.cpp's quantizer")
    quantize(f16, missing, threads, log)
    return files


def shoal_once(llm: Any, prompts: list[list[int]], new_tokens: int, tag: str) -> tuple[dict[str, Any], list[int]]:
    """The requests at once through shoal's offline engine, each token timed as a step returns it;
    the first request's tokens."""
    from shoal import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    times: list[list[float]] = [[] for _ in prompts]
    tokens: dict[int, list[int]] = {}
    with CpuMonitor() as monitor:
        t0 = time.perf_counter()
        for i, prompt in enumerate(prompts):
            engine.add_request(f"{tag}-{i}", prompt, params)
        while engine.has_unfinished_requests():
            for output in engine.step():
                now = time.perf_counter()
                i = int(output.request_id.rsplit("-", 1)[1])
                times[i].extend([now] * len(output.new_token_ids))
                if output.finished:
                    tokens[i] = list(output.outputs[0].token_ids)
    if any(len(t) != new_tokens for t in tokens.values()) or len(tokens) != len(prompts):
        raise RuntimeError(f"shoal did not make {new_tokens} tokens for each of {len(prompts)} requests")
    metrics = token_metrics(t0, times, sum(map(len, prompts)))
    metrics["other_cores"] = monitor.other_cores
    return metrics, tokens[0]


def shoal_engine(gguf: Path, dtype: str, warm: list[list[int]], args: argparse.Namespace) -> tuple[Any, float]:
    """shoal's offline engine on the file, warmed up; and its load time. Without prefix caching: each
    repeat computes the whole prompt again, as llama.cpp's fresh process does."""
    from shoal import LLM

    start = time.perf_counter()
    llm = LLM(
        str(gguf),
        dtype=dtype,
        device="cpu",
        kv_cache_bytes=256 << 20,
        num_threads=args.threads,
        enable_prefix_caching=False,
    )
    load_s = time.perf_counter() - start
    shoal_once(llm, warm, 8, "warm")
    return llm, load_s


def bench_shoal(llm: Any, dtype: str, prompts: list[list[int]], args: argparse.Namespace, tag: str) -> dict:
    metrics, tokens = measured(
        f"shoal {dtype}", lambda attempt: shoal_once(llm, prompts, args.new_tokens, f"{tag}-{attempt}"), args, log
    )
    metrics.update(dtype_run=str(llm.engine.dtype), tokens=tokens)
    return metrics


def bench_llama(gguf: Path, prompts: list[list[int]], warm: list[list[int]], args: argparse.Namespace) -> dict:
    python = llama_python(log)
    use_extra, note = extra_buffers_work(python, gguf, args.threads)

    def attempt(_: int) -> tuple[dict[str, Any], list[int]]:
        request = {
            "mode": "single" if len(prompts) == 1 else "batched",
            "gguf": str(gguf),
            "threads": args.threads,
            "use_extra_bufts": use_extra,
            "new_tokens": args.new_tokens,
            "warm": warm,
            "prompts": prompts,
        }
        done = _run(python, request)
        lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
        if done.returncode != 0 or not lines:
            raise RuntimeError(f"llama.cpp run failed ({done.returncode}): {done.stderr[-3000:]}")
        result = json.loads(lines[-1].removeprefix(RESULT_PREFIX))
        metrics = token_metrics(result["t0"], result["times"], sum(map(len, prompts)))
        metrics.update(other_cores=result["other_cores"], version=result["version"], setup=note)
        return metrics, result["outputs"][0]

    metrics, tokens = measured("llama.cpp", attempt, args, log)
    metrics["tokens"] = tokens
    return metrics


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--types", default="Q4_K_M,Q5_K_M")
    parser.add_argument("--concurrency", default="1", help="requests at once, e.g. 1,32")
    parser.add_argument("--shoal-dtypes", default="float32,auto", help="shoal's activation dtypes")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each engine; medians reported")
    parser.add_argument("--retries", type=int, default=2)
    parser.add_argument("--noise-threshold", type=float, default=0.3, help="other processes' cores")
    parser.add_argument("--wait-idle", type=float, default=60.0, help="seconds to wait for an idle CPU")
    parser.add_argument("--out-dir", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args()

    types = args.types.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    files = model_files(args.model, types, args.threads)
    rng = random.Random(9)

    def prompts(count: int) -> list[list[int]]:
        return [[rng.randrange(3, 49152) for _ in range(args.prompt_tokens)] for _ in range(count)]

    asked = {c: prompts(c) for c in levels}
    warm = {c: prompts(c) for c in levels}
    cpu = cpu_description()
    log(
        f"CPU: {cpu}; {args.model}; {args.threads} threads; prompts of {args.prompt_tokens} tokens, "
        f"{args.new_tokens} new, c={args.concurrency}"
    )
    results: dict[str, Any] = {"cpu": cpu, "args": vars(args), "shape": SHAPES[args.model], "runs": {}}
    dtypes = args.shoal_dtypes.split(",")
    for kind in types:
        gguf = files[kind]
        engines = {dtype: shoal_engine(gguf, dtype, warm[max(levels)], args) for dtype in dtypes}
        for c in levels:
            cell = f"{kind} c={c}"
            runs: dict[str, list[dict[str, Any]]] = {"llama.cpp": [], **{f"shoal {d}": [] for d in dtypes}}
            for repeat in range(args.repeats):  # the engines take turns, so a slow spell hits all of them
                runs["llama.cpp"].append(bench_llama(gguf, asked[c], warm[c], args))
                for dtype, (llm, _) in engines.items():
                    runs[f"shoal {dtype}"].append(bench_shoal(llm, dtype, asked[c], args, f"{kind}-{c}-{repeat}"))
            summary = {
                name: {key: statistics.median(m[key] for m in ms) for key in MEDIANS} for name, ms in runs.items()
            }
            llama = summary["llama.cpp"]
            for name, m in summary.items():
                tokens = runs[name][0]["tokens"]
                same = sum(a == b for a, b in zip(tokens, runs["llama.cpp"][0]["tokens"]))
                log(
                    f"{cell:12s} {name:14s} e2e {m['end_to_end_tok_s']:7.2f} tok/s "
                    f"({m['end_to_end_tok_s'] / llama['end_to_end_tok_s']:4.2f}x)  "
                    f"gen {m['gen_tok_s']:7.2f} tok/s ({m['gen_tok_s'] / llama['gen_tok_s']:4.2f}x)  "
                    f"TTFT {m['ttft_ms_mean']:7.1f} ms  ITL p50 {m['itl_ms_p50']:6.2f} ms  "
                    f"greedy tokens as llama.cpp's {same}/{len(tokens)}  (medians of {args.repeats})"
                )
            loads = {f"shoal {dtype}": load_s for dtype, (_, load_s) in engines.items()}
            results["runs"][cell] = {
                "file_bytes": gguf.stat().st_size,
                "median": summary,
                "runs": runs,
                "load_s": loads,
            }
        for llm, _ in engines.values():
            llm.shutdown()
    out = Path(args.out_dir) / f"gguf-quant-speed-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps(results, indent=1))
    log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
