"""A matrix kept as the GGUF file stores it: rows of GGML blocks of 32 columns (Q8_0, Q4_0, Q4_1).

The native CPU kernel (invariant_linear, csrc/linear_cpu.cpp) multiplies such matrices without
dequantizing them in memory; everything else sees float values through `dequantize`.
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import numpy as np
import torch

BLOCK_COLUMNS = 32
GGML_TYPES = {
    "q8_0": gguf.GGMLQuantizationType.Q8_0,
    "q4_0": gguf.GGMLQuantizationType.Q4_0,
    "q4_1": gguf.GGMLQuantizationType.Q4_1,
}
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q4_1": 20}


@dataclass(frozen=True)
class QuantizedWeight:
    """A [rows, columns] matrix as uint8 `blocks` [rows, columns / 32 * block bytes] of GGML `kind`.

    Invariant: columns is a multiple of 32 and blocks has exactly the bytes of that many columns.
    Indexing takes whole rows (a slice or an index tensor) or, as `[:, a:b]`, whole blocks of columns,
    which is what tensor-parallel sharding and embedding lookups need."""

    blocks: torch.Tensor
    kind: str
    columns: int

    def __post_init__(self) -> None:
        if self.kind not in BLOCK_BYTES:
            raise ValueError(f"unsupported quantized kind {self.kind!r}")
        row_bytes = self.columns // BLOCK_COLUMNS * BLOCK_BYTES[self.kind]
        if self.columns % BLOCK_COLUMNS or self.blocks.shape[-1] != row_bytes:
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
        if rows != slice(None) or step != 1 or start % BLOCK_COLUMNS or stop % BLOCK_COLUMNS:
            raise ValueError(f"a {self.kind} matrix can be cut only into whole blocks of {BLOCK_COLUMNS} columns")
        per_block = BLOCK_BYTES[self.kind]
        cut = self.blocks[:, start // BLOCK_COLUMNS * per_block : stop // BLOCK_COLUMNS * per_block]
        return QuantizedWeight(cut.contiguous(), self.kind, stop - start)

    def contiguous(self) -> QuantizedWeight:
        return QuantizedWeight(self.blocks.contiguous(), self.kind, self.columns)

    def to(self, device: torch.device | str) -> QuantizedWeight:
        return QuantizedWeight(self.blocks.to(device), self.kind, self.columns)

    def dequantize(self) -> torch.Tensor:
        """The float32 values (on the CPU), as GGML defines them."""
        values = gguf.quants.dequantize(self.blocks.cpu().numpy(), GGML_TYPES[self.kind])
        return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32))
