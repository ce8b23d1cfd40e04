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
    """An adapter's A and B of every projection it adapts, on the model's device: float32 A [r, in]
    and B transposed [r, out] for the CPU kernel (csrc/lora_cpu.cpp), else A and B packed for the
    row-invariant matrix multiply in the model's dtype. Invariant: a projection has an entry exactly
    where the adapter adapts it."""

    def __init__(self, adapter: LoraAdapter, dtype: torch.dtype, device: torch.device, tile_rows: int, prepack: bool):
        self.adapter = adapter
        self.native = device.type == "cpu" and load_native_kernels() is not None
        if self.native:
            self.factors = {key: (p.a.to(device), p.b.t().contiguous().to(device)) for key, p in adapter.pairs.items()}
        else:
            self.factors = {
                key: (
                    InvariantLinear([p.a.to(device, dtype)], None, tile_rows, prepack),
                    InvariantLinear([p.b.to(device, dtype)], None, tile_rows, prepack),
                )
                for key, p in adapter.pairs.items()
            }


@dataclass(frozen=True)
class LoraBatch:
    """The adapted rows of a step: `rows` (int64 [R], ascending) and the adapter of each (`owners`,
    indices into `adapters`). Rows not in `rows` run the base model."""

    rows: torch.Tensor
    owners: torch.Tensor
    adapters: list[PackedAdapter]
    widths: dict[str, int]  # each projection's output columns in this model (this rank's, under TP)

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
        return cls(as_tensor(rows), as_tensor(owners), adapters, widths)

    def deltas(self, layer: int, projection: str, x: torch.Tensor) -> torch.Tensor:
        """float32 [R, outputs]: for the adapted rows' inputs x [R, in] (in `rows` order), the deltas
        of `projection` ("qkv", "o_proj", "gate_up" or "down_proj"; the fused ones side by side),
        zero where a row's adapter leaves a projection alone."""
        targets = FUSED_TARGETS.get(projection, (projection,))
        parts = [self._target_deltas(layer, target, x) for target in targets]
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def _target_deltas(self, layer: int, target: str, x: torch.Tensor) -> torch.Tensor:
        width = self.widths[target]
        if all(adapter.native for adapter in self.adapters):
            factors = [adapter.factors.get((layer, target), (_NONE, _NONE)) for adapter in self.adapters]
            return torch.ops.shoal.lora_rows(x, self.owners, [a for a, _ in factors], [b for _, b in factors], width)
        out = torch.zeros(len(self.owners), width, dtype=torch.float32, device=x.device)
        for index, adapter in enumerate(self.adapters):
            pair = adapter.factors.get((layer, target))
            if pair is not None:
                mine = (self.owners == index).nonzero().squeeze(1)
                out[mine] = pair[1](pair[0](x.index_select(0, mine))).float()
        return out


_NONE = torch.empty(0)
