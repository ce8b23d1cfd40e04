"""LoRA in a forward step: which rows run which adapter, and each projection's deltas for them.

A step's rows may run different adapters and the base model side by side. For the rows of each
adapter, a projection's delta is B (A x) (B holding the scaling), computed by shoal's row-invariant
matrix multiply (model.invariant_linear: "shrink" by A, "expand" by B, as Punica's SGMV does on
GPUs); rows without an adapter get none and run exactly as in a step without LoRA. So a row's bits
depend on its own adapter alone, whatever the others run.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.model.invariant_linear import InvariantLinear
from shoal.model.lora_adapter import LoraAdapter, projection_shape

# The projections whose outputs a layer joins before one kernel call: q/k/v, and gate/up.
FUSED_TARGETS = {"qkv": ("q_proj", "k_proj", "v_proj"), "gate_up": ("gate_proj", "up_proj")}


class PackedAdapter:
    """An adapter's A and B of every projection it adapts, packed for the model's dtype and device.
    Invariant: pairs[(layer, target)] exists exactly where the adapter has that projection."""

    def __init__(self, adapter: LoraAdapter, dtype: torch.dtype, device: torch.device, tile_rows: int, prepack: bool):
        self.adapter = adapter
        self.pairs = {
            key: (
                InvariantLinear([pair.a.to(device, dtype)], None, tile_rows, prepack),
                InvariantLinear([pair.b.to(device, dtype)], None, tile_rows, prepack),
            )
            for key, pair in adapter.pairs.items()
        }

    def delta(self, layer: int, target: str, x: torch.Tensor) -> torch.Tensor | None:
        """B (A x) of the projection for rows x (in the model's dtype), float32; None where the
        adapter leaves the projection alone."""
        pair = self.pairs.get((layer, target))
        return None if pair is None else pair[1](pair[0](x)).float()


@dataclass(frozen=True)
class LoraBatch:
    """The adapted rows of a step: `rows` (int64 [R], ascending) and the adapter of each (`owners`,
    indices into `adapters`). Rows not in `rows` run the base model."""

    rows: torch.Tensor
    owners: list[int]
    adapters: list[PackedAdapter]
    config: object  # the model's LlamaConfig: the projections' shapes

    @classmethod
    def of_rows(cls, row_adapters: list[PackedAdapter | None], config, device: torch.device) -> LoraBatch | None:
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
        return cls(torch.tensor(rows, dtype=torch.long, device=device), owners, adapters, config)

    def deltas(self, layer: int, projection: str, x: torch.Tensor) -> torch.Tensor:
        """float32 [R, outputs]: for the adapted rows' inputs x [R, in] (in `rows` order), the deltas
        of `projection` ("qkv", "o_proj", "gate_up" or "down_proj"; the fused ones side by side),
        zero where a row's adapter leaves a projection alone."""
        targets = FUSED_TARGETS.get(projection, (projection,))
        widths = [projection_shape(self.config, target)[0] for target in targets]
        out = torch.zeros(len(self.owners), sum(widths), dtype=torch.float32, device=x.device)
        for index, adapter in enumerate(self.adapters):
            mine = torch.tensor([i for i, owner in enumerate(self.owners) if owner == index], device=x.device)
            inputs = x.index_select(0, mine)
            start = 0
            for target, width in zip(targets, widths):
                delta = adapter.delta(layer, target, inputs)
                if delta is not None:
                    out[mine, start : start + width] = delta
                start += width
        return out
