"""Each model family against a Llama of the same shape, on random weights of a real model's shape
(`benchmarks/engine.py --family qwen3-1.7b,gemma3-1b,phi4-mini`).

A family whose layers fall off the fused native path runs far slower than the Llama with its
matrices, so the ratio of the two (median decode tokens/s over --family-repeats engines of each,
built and run in turn, same prompts, same engine settings; one engine's speed varies by a third
from one allocation of its weights to the next on a small VM) says whether the family's variant (q/k norms, norms after, GeGLU, soft caps, local
RoPE bases, partial rotary, windows) costs more than its arithmetic. The configs are the public
config.json fields of each model; the weights are drawn at random (bf16, N(0, 0.02)), with the
decoder's tensor layout, so nothing is downloaded and no converter runs. `--family-layers` cuts the
layer count (the same for both sides) to iterate quickly.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
from measurement import measured

# Public config.json fields of each shape (the settings that change the layer, and its sizes).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-1.7b": dict(
        model_type="qwen3",
        hidden_size=2048,
        intermediate_size=6144,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
    "gemma3-1b": dict(
        model_type="gemma3_text",
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        vocab_size=262144,
        query_pre_attn_scalar=256,
        sliding_window=512,
        sliding_window_pattern=6,
        rope_theta=1000000.0,
        rope_local_base_freq=10000.0,
        rms_norm_eps=1e-6,
        max_position_embeddings=32768,
        hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
    ),
    "phi4-mini": dict(
        model_type="phi3",
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=200064,
        partial_rotary_factor=0.75,
        original_max_position_embeddings=4096,
        max_position_embeddings=131072,
        rope_theta=10000.0,
        rope_scaling={"rope_type": "longrope", "short_factor": [1.0] * 48, "long_factor": [2.0] * 48},
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    ),
}
# A Qwen3-MoE scaled to this machine (gguf_quant_speed.py's): 32 experts of 512, the best 8 a token.
SHAPES["qwen3-moe-0.9b"] = {
    **SHAPES["qwen3-1.7b"],
    "model_type": "qwen3_moe",
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "moe_intermediate_size": 512,
    "num_experts": 32,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "tie_word_embeddings": False,
}
# Qwen3-0.6B and Gemma 3 270M: the layers of Qwen3-1.7B and Gemma 3 1B at their own widths.
SHAPES["qwen3-0.6b"] = {**SHAPES["qwen3-1.7b"], "hidden_size": 1024, "intermediate_size": 3072}
SHAPES["gemma3-270m"] = {
    **SHAPES["gemma3-1b"],
    "hidden_size": 640,
    "intermediate_size": 2048,
    "num_hidden_layers": 18,
}
# The fields a Llama of the same shape keeps.
LLAMA_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "rms_norm_eps",
    "max_position_embeddings",
    "tie_word_embeddings",
)


def llama_of_shape(raw: dict[str, Any]) -> dict[str, Any]:
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    return {"model_type": "llama", **{k: raw[k] for k in LLAMA_FIELDS if k in raw}, "head_dim": head_dim}


def random_checkpoint(raw: dict[str, Any], layers: int | None) -> Any:
    """A Checkpoint of the config.json fields `raw` (its layer count cut to `layers`), random bf16
    weights in the decoder's layout, and a word-level tokenizer of one token per id."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models

    from shoal.model.families import family_of_hf_model_type
    from shoal.model.hf_loader import config_from_hf
    from shoal.model.layout import required_shapes
    from shoal.model.loader import Checkpoint
    from shoal.model.tokenizer import Tokenizer

    raw = {**raw, "num_hidden_layers": layers or raw["num_hidden_layers"], "bos_token_id": 1, "eos_token_id": 2}
    config = config_from_hf(raw, family_of_hf_model_type(raw["model_type"], raw["model_type"]))
    generator = torch.Generator().manual_seed(0)
    weights = {}
    for name, shape in required_shapes(config).items():
        tensor = torch.randn(shape, generator=generator) * (0.02 if len(shape) == 2 else 0.1)
        weights[name] = (tensor + (1.0 if len(shape) == 1 else 0.0)).bfloat16()
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    backend = Backend(models.WordLevel(vocab, unk_token="t0"))
    backend.decoder = decoders.Fuse()
    tokenizer = Tokenizer(backend, special_tokens={"eos_token": "t2"}, chat_template=None)
    return Checkpoint(config, weights, tokenizer, source=f"random {raw['model_type']}")


def decode_speed(
    checkpoint: Any,
    args: argparse.Namespace,
    shoal_run: Callable[..., tuple[dict[str, Any], Any]],
    log: Callable[[str], None],
    tag: str,
) -> dict[str, Any]:
    """Tokens/s of one engine over the shape's model, per concurrency (prompts of --prompt-tokens
    random ids, --new-tokens each, greedy, ignore_eos); a run that other processes disturbed is
    repeated (measurement.measured)."""
    from shoal.config.engine import EngineConfig
    from shoal.engine.engine import LLMEngine

    config = EngineConfig(
        model=checkpoint.source,
        dtype="bfloat16",
        device="cpu",
        kv_cache_bytes=args.kv_cache_bytes,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=4096,
    )
    started = time.perf_counter()
    engine = LLMEngine(config, checkpoint=checkpoint)
    paths = {"native" if layer.native is not None else "torch" for layer in engine.model.layers}
    log(f"  {tag}: engine up in {time.perf_counter() - started:.0f} s; layers on the {', '.join(sorted(paths))} path")
    generator = torch.Generator().manual_seed(1)
    vocab = checkpoint.config.vocab_size
    runs = {}
    for concurrency in args.concurrency:
        prompts = [
            torch.randint(3, vocab, (args.prompt_tokens or 128,), generator=generator).tolist()
            for _ in range(concurrency)
        ]
        shoal_run(SimpleNamespace(engine=engine), prompts, args.new_tokens, f"{tag}-warm-{concurrency}")
        metrics, _ = measured(
            f"{tag} c={concurrency}",
            lambda attempt: shoal_run(
                SimpleNamespace(engine=engine), prompts, args.new_tokens, f"{tag}-{concurrency}-{attempt}"
            ),
            args,
            log,
        )
        runs[concurrency] = metrics
        log(f"  {tag} c={concurrency}: {metrics['gen_tok_s']:.1f} tok/s, ITL p50 {metrics['itl_ms_p50']:.1f} ms")
    engine.shutdown()
    return {"paths": sorted(paths), "runs": runs}


def bench_families(
    args: argparse.Namespace, shoal_run: Callable[..., tuple[dict[str, Any], Any]], log: Callable[[str], None]
) -> dict[str, Any]:
    """For each named shape: the family's speeds, the same-shape Llama's, and their ratio."""
    results = {}
    for name in args.family:
        if name not in SHAPES:
            raise SystemExit(f"unknown family shape {name!r} ({', '.join(SHAPES)})")
        raw = SHAPES[name]
        sides: dict[str, list[dict[str, Any]]] = {"family": [], "llama": []}
        for repeat in range(args.family_repeats):
            for side, fields in (("family", raw), ("llama", llama_of_shape(raw))):
                checkpoint = random_checkpoint(fields, args.family_layers)
                architecture = checkpoint.config.architecture
                log(f"{name} ({side}, {repeat + 1} of {args.family_repeats}): {architecture}")
                sides[side].append(decode_speed(checkpoint, args, shoal_run, log, f"{name}/{side}"))
                del checkpoint
                gc.collect()
        medians = {
            side: {c: statistics.median(run["runs"][c]["gen_tok_s"] for run in runs) for c in args.concurrency}
            for side, runs in sides.items()
        }
        ratios = {c: medians["family"][c] / medians["llama"][c] for c in args.concurrency}
        log(f"{name}: median family / llama tokens/s " + ", ".join(f"c={c} {r:.2f}" for c, r in ratios.items()))
        results[name] = {
            **sides,
            "median_tok_s": medians,
            "ratio": ratios,
            "layers": args.family_layers or raw["num_hidden_layers"],
        }
    return results
