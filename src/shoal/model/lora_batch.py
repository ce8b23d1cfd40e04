"""LoRA in a forward step: which rows run which adapter, and each projection's deltas for them.

A step's rows may run different adapters and the base model side by side. For the rows of each
adapter, a projection's delta is B (A x) (B holding the scaling), for all the step's adapted rows
in one call of the CPU kernel (csrc/lora_cpu.cpp: "shrink" by A, "expand" by B, as Punica's SGMV
does on GPUs; elsewhere shoal's row-invariant matrix multiply, adapter by adapter); rows without an
adapter get none and run exactly as in a step without LoRA. So a row's bits
depend on its own adapter alone, whatever the others run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.model.invariant_linear import InvariantLinear
from shoal.model.lora_adapter import LoraAdapter
from shoal.model.native_kernels import load_native_kernels

# The projections whose outputs a layer joins before one kernel call: q/k/v, and gate/up.
FUSED_TARGETS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


class PackedAdapter:
    """An adapter's A and B of every projection it adapts, on the model's device: A [r, in] and B in
    panels of 16 outputs [ceil(out / 16), r, 16] for the CPU kernel (csrc/lora_cpu.cpp; bfloat16 for
    a bfloat16 model, else float32), else A and B packed for the
    row-invariant matrix multiply in the model's dtype. Invariant: a projection has an entry exactly
    where the adapter adapts it."""

    def __init__(self, adapter: LoraAdapter, dtype: torch.dtype, device: torch.device, tile_rows: int, prepack: bool):
        self.adapter = adapter
        self.native = device.type == "cpu" and load_native_kernels() is not None
        if self.native:  # bfloat16 for a bfloat16 model (half the bytes each step reads), else float32
            kind = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
            self.factors = {
                key: (p.a.to(device, kind).contiguous(), _panels(p.b).to(device, kind).contiguous())
                for key, p in adapter.pairs.items()
            }
        else:
            self.factors = {
                key: (
                    InvariantLinear([p.a.to(device, dtype)], None, tile_rows, prepack),
                    InvariantLinear([p.b.to(device, dtype)], None, tile_rows, prepack),
                )
                for key, p in adapter.pairs.items()
            }


def _panels(b: torch.Tensor) -> torch.Tensor:
    """B [out, r] as the CPU kernel reads it: panels of 16 outputs, [ceil(out / 16), r, 16], the
    last panel's missing outputs zero."""
    out, rank = b.shape
    padded = torch.nn.functional.pad(b, (0, 0, 0, -out % 16))
    return padded.reshape(-1, 16, rank).transpose(1, 2)


@dataclass(frozen=True)
class LoraBatch:
    """The adapted rows of a step: `rows` (int64 [R], ascending) and the adapter of each (`owners`,
    indices into `adapters`). Rows not in `rows` run the base model."""

    rows: torch.Tensor
    owners: torch.Tensor
    adapters: list[PackedAdapter]
    widths: dict[str, int]  # each projection's output columns in this model (this rank's, under TP)
    every_row: bool = False  # every row of the step is adapted (`rows` is 0..T-1)

    @classmethod
    def of_rows(
        cls, row_adapters: list[PackedAdapter | None], widths: dict[str, int], device: torch.device
    ) -> LoraBatch | None:
        """From each row's adapter (None: the base model); None when no row has one."""
        adapters: list[PackedAdapter] = []
        rows, owners = [], []
        for row, adapter in enumerate(row_adapters):
            if adapter is None:
                continue
            if adapter not in adapters:
                adapters.append(adapter)
            rows.append(row)
            owners.append(adapters.index(adapter))
        if not rows:
            return None
        as_tensor = lambda values: torch.tensor(values, dtype=torch.long, device=device)  # noqa: E731
        return cls(as_tensor(rows), as_tensor(owners), adapters, widths, len(rows) == len(row_adapters))

    def picked(self, x: torch.Tensor) -> torch.Tensor:
        """The adapted rows of a step's x [T, ...], in `rows` order (x itself where every row is)."""
        return x if self.every_row else x.index_select(0, self.rows)

    def deltas(self, layer: int, projection: str, x: torch.Tensor) -> torch.Tensor:
        """float32 [R, outputs]: for the adapted rows' inputs x [R, in] (in `rows` order), the deltas
        of `projection` ("qkv", "o_proj", "gate_up" or "down_proj"; the fused ones side by side),
        zero where a row's adapter leaves a projection alone."""
        targets = FUSED_TARGETS.get(projection, (projection,))
        widths = [self.widths[target] for target in targets]
        if all(adapter.native for adapter in self.adapters):
            factors = [
                adapter.factors.get((layer, target), _NO_PAIR) for target in targets for adapter in self.adapters
            ]
            return torch.ops.shoal.lora_rows(x, self.owners, [a for a, _ in factors], [b for _, b in factors], widths)
        out = torch.zeros(len(self.owners), sum(widths), dtype=torch.float32, device=x.device)
        start = 0
        for target, width in zip(targets, widths):
            for index, adapter in enumerate(self.adapters):
                pair = adapter.factors.get((layer, target))
                if pair is not None:
                    mine = (self.owners == index).nonzero().squeeze(1)
                    out[mine, start : start + width] = pair[1](pair[0](x.index_select(0, mine))).float()
            start += width
        return out


_NO_PAIR = (torch.empty(0), torch.empty(0))
