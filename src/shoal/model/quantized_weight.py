"""A matrix kept as the GGUF file stores it: rows of GGML blocks of 32 columns (Q8_0, Q4_0, Q4_1,
Q5_0, Q5_1, IQ4_NL, MXFP4) or 256 (the K-quants Q2_K to Q6_K, and IQ4_XS), or of 16-bit floats
(F16, BF16: one value a block).

The native CPU kernel (invariant_linear, csrc/linear_cpu.cpp) multiplies such matrices without
dequantizing them in memory; everything else sees float values through `dequantize`.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

GGML_TYPES = {
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
    "q5_0": gguf.GGMLQuantizationType.Q5_0,
    "q5_1": gguf.GGMLQuantizationType.Q5_1,
    "iq4_nl": gguf.GGMLQuantizationType.IQ4_NL,
    "mxfp4": gguf.GGMLQuantizationType.MXFP4,
    "q2_k": gguf.GGMLQuantizationType.Q2_K,
    "q3_k": gguf.GGMLQuantizationType.Q3_K,
    "q4_k": gguf.GGMLQuantizationType.Q4_K,
    "q5_k": gguf.GGMLQuantizationType.Q5_K,
    "q6_k": gguf.GGMLQuantizationType.Q6_K,
    "iq4_xs": gguf.GGMLQuantizationType.IQ4_XS,
    # 16-bit floats, kept as the file stores them (blocks of one value, two bytes).
    "f16": gguf.GGMLQuantizationType.F16,
    "bf16": gguf.GGMLQuantizationType.BF16,
}
# Bytes a weight of each kind takes once packed for the native kernel (csrc/panel_layout.h: per
# 32 k of 16 columns, the format's scales and its values, nibbles or bytes; 16-bit values as they are).
PACKED_BYTES_PER_WEIGHT = {
    "q8_0": 544 / 512,
    "q4_0": 320 / 512,
    "q4_1": 320 / 512,
    "q5_0": 544 / 512,
    "q5_1": 640 / 512,
    "iq4_nl": 544 / 512,
    "mxfp4": 640 / 512,
    "q2_k": 768 / 512,
    "q3_k": 640 / 512,
    "q4_k": 384 / 512,
    "q5_k": 640 / 512,
    "q6_k": 640 / 512,
    "iq4_xs": 640 / 512,
    "f16": 2,
    "bf16": 2,
}
# The kinds whose blocks are 16-bit floats, and their torch dtype.
FLOAT_KINDS = {"f16": torch.float16, "bf16": torch.bfloat16}
# (columns, bytes) of one block.
BLOCKS = {kind: tuple(gguf.GGML_QUANT_SIZES[ggml_type]) for kind, ggml_type in GGML_TYPES.items()}


@dataclass(frozen=True)
class QuantizedWeight:
    """A [rows, columns] matrix as uint8 `blocks` [rows, columns / block columns * block bytes] of
    GGML `kind`.

    Invariant: columns is a multiple of the block's columns and blocks has exactly the bytes of that
    many columns.
    Indexing takes whole rows (a slice or an index tensor) or, as `[:, a:b]`, whole blocks of columns,
    which is what tensor-parallel sharding and embedding lookups need."""

    blocks: torch.Tensor
    kind: str
    columns: int

    def __post_init__(self) -> None:
        if self.kind not in BLOCKS:
            raise ValueError(f"unsupported quantized kind {self.kind!r}")
        block_columns, block_bytes = BLOCKS[self.kind]
        if self.columns % block_columns or self.blocks.shape[-1] != self.columns // block_columns * block_bytes:
            shape = tuple(self.blocks.shape)
            raise ValueError(f"{self.kind} blocks of shape {shape} do not hold {self.columns} columns")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.blocks.shape[0], self.columns))

    @property
    def device(self) -> torch.device:
        return self.blocks.device

    def __getitem__(self, index) -> QuantizedWeight:
        if not isinstance(index, tuple):
            return QuantizedWeight(self.blocks[index], self.kind, self.columns)
        rows, columns = index
        start, stop, step = columns.indices(self.columns)
        block_columns, block_bytes = BLOCKS[self.kind]
        if rows != slice(None) or step != 1 or start % block_columns or stop % block_columns:
            raise ValueError(f"a {self.kind} matrix can be cut only into whole blocks of {block_columns} columns")
        cut = self.blocks[:, start // block_columns * block_bytes : stop // block_columns * block_bytes]
        return QuantizedWeight(cut.contiguous(), self.kind, stop - start)

    def contiguous(self) -> QuantizedWeight:
        return QuantizedWeight(self.blocks.contiguous(), self.kind, self.columns)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return QuantizedWeight(self.blocks.to(device), self.kind, self.columns)

    def kernel_input(self) -> torch.Tensor:
        """What the native matrix multiply packs: the rows of GGML blocks as bytes, or for the 16-bit
        kinds the values themselves."""
        blocks = self.blocks.contiguous()
        return blocks.view(FLOAT_KINDS[self.kind]) if self.kind in FLOAT_KINDS else blocks

    def dequantize(self) -> torch.Tensor:
        """The float32 values (on the CPU), as GGML defines them."""
        values = gguf.quants.dequantize(self.blocks.cpu().numpy(), GGML_TYPES[self.kind])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
