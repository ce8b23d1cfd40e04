"""The model's matrix multiplies alone, per kernel and weight format, against the weight stream.

SmolLM2-135M's projection shapes (q/k/v fused, o, gate/up fused, down) in 30 layers of distinct
random weights, so every call streams its weights from memory as a decode step does, at M rows:

- `torch F.linear`: torch's own GEMM (oneDNN, shapes chosen per M; not batch invariant);
- `oneDNN tiles`: the tiled backend (32-row tiles, the default before the native kernel);
- `native <format>`: shoal's kernel (csrc/linear_cpu.cpp) on packed f32, bf16 (AMX tiles where the
  CPU has them), Q8_0 and Q4_1 weights.

`stream` is the time to read each format's packed weights once (a sum over them, per tensor): the
floor for one row. Best of --repeats. The bf16 GEMM peak is the best bf16 kernel at its best row
count; `--prefill N` also times the engine's prefill of an N-token prompt against it. Usage:

    .venv/bin/python benchmarks/linear_kernels.py [--rows 1,8,32,64] [--repeats 7] [--prefill 1024]
"""

from __future__ import annotations

import argparse
import time

import gguf
import numpy as np
import torch
from cpu_name import cpu_description

from shoal.model.invariant_linear import InvariantLinear
from shoal.model.quantized_weight import GGML_TYPES, QuantizedWeight

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (N, K) of one SmolLM2 layer
LAYERS = 30
MACS_PER_ROW = LAYERS * sum(n * k for n, k in SHAPES)  # one row through every layer's projections


def quantized(weight: torch.Tensor, kind: str) -> QuantizedWeight:
    blocks = gguf.quants.quantize(weight.numpy(), GGML_TYPES[kind]).view(np.uint8).reshape(weight.shape[0], -1)
    return QuantizedWeight(torch.from_numpy(blocks.copy()), kind, weight.shape[1])


def weight_bytes(layer: torch.Tensor | InvariantLinear) -> int:
    """The bytes a multiply reads of its weights: packed, or as they lie."""
    if isinstance(layer, torch.Tensor):
        return layer.numel() * layer.element_size()
    if layer.backend == "native":
        return layer.packed.packed_bytes()
    return sum(w.numel() * w.element_size() for w in layer.weights)


def best_ms(fn, repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--prefill", type=int, default=0, help="also the engine's prefill of a prompt of N tokens")
    args = parser.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)
    dense = [torch.randn(n, k) * 0.02 for _ in range(LAYERS) for n, k in SHAPES]
    kernels = {
        "torch F.linear bf16": ([w.bfloat16() for w in dense], torch.bfloat16, None),
        "oneDNN tiles bf16": ([InvariantLinear([w.bfloat16()], None, 32, False) for w in dense], torch.bfloat16, None),
        "native bf16": ([InvariantLinear([w.bfloat16()], None, 32, True) for w in dense], torch.bfloat16, None),
        "native f32": ([InvariantLinear([w], None, 16, True) for w in dense], torch.float32, None),
        **{
            f"native {kind}": (
                [InvariantLinear([quantized(w, kind)], None, 16, True) for w in dense],
                torch.float32,
                kind,
            )
            for kind in ("q8_0", "q4_1")
        },
        **{
            f"native {kind} bf16 x": (
                [InvariantLinear([quantized(w, kind)], None, 16, True) for w in dense],
                torch.bfloat16,
                kind,
            )
            for kind in ("q8_0", "q4_1")
        },
    }
    print(f"CPU: {cpu_description()}; torch threads {torch.get_num_threads()}; {LAYERS} layers of {SHAPES}")
    print(f"{'kernel':22s} {'MB':>7s} {'stream ms':>9s} " + " ".join(f"{'M=' + str(m):>9s}" for m in rows))
    peak = 0.0
    for name, (layers, dtype, kind) in kernels.items():
        sizes = [weight_bytes(layer) for layer in layers]
        # As many bytes as each layer's weights take, in buffers of their own, summed as floats.
        floats = [torch.ones(size // 4) for size in sizes]
        megabytes = sum(sizes) / 1e6
        stream = best_ms(lambda: [f.sum() for f in floats], args.repeats)
        cells = []
        for m in rows:
            xs = {k: torch.randn(m, k).to(dtype) for k in (576, 1536)}
            if name.startswith("torch"):
                run = lambda: [torch.nn.functional.linear(xs[w.shape[1]], w) for w in layers]  # noqa: E731
            else:
                run = lambda: [layer(xs[k]) for layer, (_, k) in zip(layers, SHAPES * LAYERS)]  # noqa: E731
            cells.append(best_ms(run, args.repeats))
        print(f"{name:22s} {megabytes:7.1f} {stream:9.2f} " + " ".join(f"{c:9.2f}" for c in cells), flush=True)
        if dtype == torch.bfloat16 and kind is None:
            peak = max(peak, max(MACS_PER_ROW * m / (c / 1e3) for m, c in zip(rows, cells)))
    print(f"bf16 GEMM peak here: {peak / 1e9:.0f} G multiply-adds/s (the best bf16 kernel's best row count)")
    if args.prefill:
        prefill(args.prefill, peak, args.repeats)


def prefill(prompt_tokens: int, peak: float, repeats: int) -> None:
    """The engine's prefill (its defaults: `auto` dtype, the bundled GGUF's blocks) of one prompt of
    `prompt_tokens` random token ids, as multiply-adds a second against `peak`: the projections'
    (every token), attention's (each token over the keys before it) and the LM head's (the last)."""
    from shoal import LLM, SamplingParams

    llm = LLM()
    config = llm.engine.model.config
    heads, dim, vocab = config.num_heads, config.head_dim, config.vocab_size
    macs = (
        prompt_tokens * MACS_PER_ROW
        + LAYERS * heads * dim * 2 * prompt_tokens * (prompt_tokens + 1) // 2
        + config.hidden_size * vocab
    )
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    generator = torch.Generator().manual_seed(1)
    best = float("inf")
    for _ in range(repeats + 1):  # the first warms up
        prompt = torch.randint(1000, vocab - 1000, (prompt_tokens,), generator=generator).tolist()
        started = time.perf_counter()
        llm.generate([prompt], params)
        best = min(best, time.perf_counter() - started)
    rate = macs / best
    print(
        f"prefill of {prompt_tokens} tokens ({llm.engine.dtype}, {llm.engine.model.layers[0].qkv.description}): "
        f"{best * 1e3:.0f} ms, {prompt_tokens / best:.0f} tokens/s, {rate / 1e9:.0f} G multiply-adds/s = "
        f"{rate / peak:.0%} of the bf16 GEMM peak"
    )


if __name__ == "__main__":
    main()
