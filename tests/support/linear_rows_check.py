"""The bitwise row check of the native matrix multiply, on this process's instruction set (run in a
process under SHOAL_CPU_ISA, as tests.support.engine_under_isa_cap does, for a narrower path).

For every weight format (quantized ones against float32 and bfloat16 x), row r of the output is the
same bits for M = 1..70, 128 and 512, with r first, in the middle and last in the batch; the report
has, per format, the rows that differed (none is the pass) and the largest error against float64.
"""

from __future__ import annotations

ROW_COUNTS = (*range(1, 71), 128, 512)
# Relative error of the whole product against float64 over the same (dequantized) weights:
# float32 accumulation, and 16-bit outputs rounded once.
SMALL_BLOCKS = ("q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "iq4_nl", "mxfp4")  # blocks of 32 columns
K_QUANTS = ("q2_k", "q3_k", "q4_k", "q5_k", "q6_k", "iq4_xs")  # blocks of 256 columns
TOLERANCE = {
    "f32": 1e-5,
    **{kind: 1e-5 for kind in SMALL_BLOCKS + K_QUANTS},
    "bf16": 4e-3,
    "f16": 5e-4,
    # Quantized blocks against bfloat16 x (bf16 dot products): exact products, 16-bit outputs.
    **{f"{kind} bf16 x": 4e-3 for kind in SMALL_BLOCKS + K_QUANTS},
}
# Where each kind's fp16 scales lie in its block (gguf cannot quantize to these kinds).
RANDOM_BLOCK_SCALES = {
    "iq4_nl": (0,),
    "q2_k": (80, 82),
    "q3_k": (108,),
    "q4_k": (0, 2),
    "q5_k": (0, 2),
    "q6_k": (208,),
    "iq4_xs": (0,),
}


def quantized(weight, kind):
    """`weight` quantized to `kind`; for the kinds gguf cannot quantize to, random blocks of its
    shape instead (any bytes are valid blocks once their fp16 scales are finite)."""
    import hashlib

    import gguf
    import numpy as np
    import torch

    from shoal.model.quantized_weight import BLOCKS, GGML_TYPES, QuantizedWeight

    rows, columns = weight.shape
    if kind not in RANDOM_BLOCK_SCALES:
        blocks = gguf.quants.quantize(weight.numpy(), GGML_TYPES[kind]).view(np.uint8).reshape(rows, -1)
        return QuantizedWeight(torch.from_numpy(blocks.copy()), kind, columns)
    block_columns, block_bytes = BLOCKS[kind]
    # Seeded by the weight's bytes: a float sum's last bits follow ATen's instruction set.
    generator = np.random.default_rng(int.from_bytes(hashlib.sha256(weight.numpy().tobytes()).digest()[:8]))
    blocks = generator.integers(0, 256, size=(rows, columns // block_columns, block_bytes), dtype=np.uint8)
    for offset in RANDOM_BLOCK_SCALES[kind]:  # d (and dmin)
        scales = generator.uniform(1, 2, size=blocks.shape[:2]) * 2.0**-8
        blocks[..., offset : offset + 2] = scales.astype(np.float16)[..., None].view(np.uint8)
    return QuantizedWeight(torch.from_numpy(blocks.reshape(rows, -1)), kind, columns)


def check(in_features: int = 576, out_features: int = 200) -> dict:
    """Per format: rows that depended on the batch, and the relative error of the whole product
    (K-quants over 512 input features, a whole number of their 256-column blocks)."""
    import torch

    from shoal.model.invariant_linear import InvariantLinear

    torch.manual_seed(0)
    dense = [torch.randn(out_features, in_features), torch.randn(40, in_features)]
    wide = [torch.randn(out_features, 512), torch.randn(40, 512)]
    biases = [torch.randn(out_features), None]
    cases = {
        "f32": (dense, torch.float32),
        "bf16": ([w.bfloat16() for w in dense], torch.bfloat16),
        "f16": ([w.half() for w in dense], torch.float16),
        **{kind: ([quantized(w, kind) for w in dense], torch.float32) for kind in SMALL_BLOCKS},
        **{kind: ([quantized(w, kind) for w in wide], torch.float32) for kind in K_QUANTS},
        **{f"{kind} bf16 x": ([quantized(w, kind) for w in dense], torch.bfloat16) for kind in SMALL_BLOCKS},
        **{f"{kind} bf16 x": ([quantized(w, kind) for w in wide], torch.bfloat16) for kind in K_QUANTS},
    }
    report = {}
    for name, (weights, dtype) in cases.items():
        columns = weights[0].shape[1]
        linear = InvariantLinear(weights, [b.to(dtype) if b is not None else None for b in biases], 16, True)
        assert linear.backend == "native", name
        reference = torch.cat([w.dequantize() if hasattr(w, "dequantize") else w.double() for w in weights]).double()
        rows = torch.randn(3, columns).to(dtype)
        alone = [linear(rows[i : i + 1])[0] for i in range(3)]
        differing = []
        for count in ROW_COUNTS:
            batch = torch.randn(count, columns).to(dtype)
            placed = {place: i for i, place in enumerate((0, count // 2, count - 1))}  # small batches: fewer
            for place, i in placed.items():
                batch[place] = rows[i]
            out = linear(batch)
            differing += [[count, place] for place, i in placed.items() if not torch.equal(out[place], alone[i])]
        full = torch.cat([b if b is not None else torch.zeros(w.shape[0]) for w, b in zip(weights, biases)])
        exact = batch.double() @ reference.T + full.to(dtype).double()
        error = ((out.double() - exact).abs().max() / exact.abs().max()).item()
        report[name] = {"differing": differing, "relative_error": error}
    return report


def bf16_pairs_digest() -> str:
    """SHA-256 of quantized blocks (every format) multiplied with bfloat16 x on this process's path:
    AVX512-BF16 dot products where the level has them, their emulation with FMAs below, which is to
    give the same bits."""
    import hashlib

    import torch

    from shoal.model.invariant_linear import InvariantLinear

    torch.manual_seed(5)
    digest = hashlib.sha256()
    for kind in SMALL_BLOCKS + K_QUANTS:
        columns = 512 if kind in K_QUANTS else 576
        linear = InvariantLinear([quantized(torch.randn(70, columns), kind)], [torch.randn(70)], 16, True)
        for rows in (1, 7, 40):
            digest.update(linear(torch.randn(rows, columns).bfloat16()).view(torch.int16).numpy().tobytes())
    return digest.hexdigest()
