"""Tensor parallelism inside one replica: how the weights are split and how partial results meet.

Attention is split by key/value-head groups: each rank holds whole groups (its KV heads and the
query heads that read them), so attention needs nothing from other ranks. The MLP is split by
intermediate columns, a mixture's experts each by theirs (the router stays whole on every rank),
or, with expert parallelism, a mixture's experts by expert: each rank holds whole experts (a
contiguous range), computes the outputs of the (row, choice)s routed to them, and the outputs of
all ranks meet in a sum where each element comes from one rank and the others add zeros (x + 0 is
x), before each row's weighted sum, in its fixed order, on every rank.
The output projections (o_proj, down_proj) are split by their output columns, each rank holding
every input column of its rows: the layer code gathers their input (the attention output, the MLP
activation) from all ranks in rank order, each rank computes its output columns, and those are
gathered. The embedding and the LM head are split by vocabulary.
Splits may be uneven (SmolLM2 has 3 KV heads, so TP=2 holds 2 + 1), which is why the
tensor-parallel size is bounded by the KV-head count.

Invariant: nothing is ever summed across ranks except the embedding lookup, where exactly one rank
holds each token's row and the others add zeros, and experts' outputs alike. Every output element of
every projection is computed whole, by one kernel call over all of K, exactly as in one process (the
native kernel's element does not depend on the columns around it), so every TP degree gives the
single process's bits, and a stream can move between replicas of different degrees token-exact."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from shoal.model.config import LlamaConfig
from shoal.model.lora_adapter import LORA_TARGETS, LoraAdapter, LoraPair, projection_shape


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in its group. `group` gathers between the ranks (`all_gather(tensor)`: every
    rank's tensor, in rank order; shared memory on CPUs, NCCL on CUDA, see parallel.tensor_group),
    owned by whoever created it; it is passed explicitly, never read from globals."""

    rank: int
    size: int
    group: Any
    expert_parallel: bool = False

    def held_experts(self, num_experts: int) -> range:
        """The experts this rank holds whole under expert parallelism."""
        return range(*self.split(num_experts))

    def split(self, count: int) -> tuple[int, int]:
        """This rank's [start, end) of `count` units, contiguous and as even as possible (the first
        count % size ranks take one more)."""
        base, extra = divmod(count, self.size)
        start = self.rank * base + min(self.rank, extra)
        return start, start + base + (self.rank < extra)

    def all_sum(self, partial: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of `partial` (same shape on every rank), added in rank order: the result
        is identical on all ranks and each row depends on that row alone."""
        parts = self._all_gather(partial.contiguous())
        total = parts[0]
        for part in parts[1:]:
            total = total + part
        return total

    def all_gather_columns(self, part: torch.Tensor, count: int, unit: int = 1) -> torch.Tensor:
        """Concatenates, in rank order, each rank's columns of a [N, count * unit] tensor: rank r holds
        units split(count) of `unit` columns each (KV-head groups, or single columns)."""
        ranks = [dataclasses.replace(self, rank=r) for r in range(self.size)]
        widths = [(end - start) * unit for start, end in (r.split(count) for r in ranks)]
        padded = torch.nn.functional.pad(part, (0, max(widths) - part.shape[1])).contiguous()
        parts = self._all_gather(padded)
        return torch.cat([p[:, :width] for p, width in zip(parts, widths)], dim=1)

    def _all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self.group.all_gather(tensor)


def check_shardable(config: LlamaConfig, size: int) -> None:
    """Raises ValueError if the model cannot be split over `size` ranks (each needs a KV head)."""
    if size > config.num_kv_heads:
        raise ValueError(f"tensor_parallel_size {size} exceeds the model's {config.num_kv_heads} KV heads")
    if size > 1 and config.qk_norm == "projection":
        raise ValueError(f"tensor parallelism does not split {config.architecture}'s norms over whole q/k projections")


def projection_rows(config: LlamaConfig, tp: TensorParallel) -> dict[str, slice]:
    """This rank's output rows of each dense projection (the model's full config): q/k/v by whole
    KV-head groups, gate/up by intermediate columns, o/down by hidden columns."""
    group, dim = config.num_queries_per_kv, config.head_dim
    kv_start, kv_end = tp.split(config.num_kv_heads)
    mlp, hidden = slice(*tp.split(config.intermediate_size)), slice(*tp.split(config.hidden_size))
    kv = slice(kv_start * dim, kv_end * dim)
    q = slice(kv_start * group * dim, kv_end * group * dim)
    return {
        "q_proj": q,
        "k_proj": kv,
        "v_proj": kv,
        "o_proj": hidden,
        "gate_proj": mlp,
        "up_proj": mlp,
        "down_proj": hidden,
    }


def projection_widths(config: LlamaConfig, tp: TensorParallel | None) -> dict[str, int]:
    """Each dense projection's output columns on this rank (`config`: the model's full config; all
    of them without tensor parallelism)."""
    if tp is None:
        return {target: projection_shape(config, target)[0] for target in LORA_TARGETS}
    return {target: rows.stop - rows.start for target, rows in projection_rows(config, tp).items()}


def shard_adapter(adapter: LoraAdapter, config: LlamaConfig, tp: TensorParallel) -> LoraAdapter:
    """This rank's part of a LoRA adapter of the model (`config`: its full config): each projection's
    B rows as the projection's own weight rows here; A whole (every input column of a projection
    is on each rank, gathered where it was split), so each output element's delta is computed whole."""
    rows = projection_rows(config, tp)
    pairs = {key: LoraPair(pair.a, pair.b[rows[key[1]]].contiguous()) for key, pair in adapter.pairs.items()}
    return dataclasses.replace(adapter, pairs=pairs)


def shard_weights(
    config: LlamaConfig, weights: dict[str, torch.Tensor], tp: TensorParallel
) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """This rank's config (its head and intermediate counts; the vocabulary stays whole) and its
    slices of the weights (views where possible, so only the shard's pages of memory-mapped weights
    are ever read)."""
    check_shardable(config, tp.size)
    group = config.num_queries_per_kv
    kv_start, kv_end = tp.split(config.num_kv_heads)
    rows = projection_rows(config, tp)
    q_rows, kv_rows = rows["q_proj"], rows["k_proj"]
    mlp_start, mlp_end = tp.split(config.intermediate_size)
    expert_start, expert_end = tp.split(config.expert_intermediate_size)
    out_start, out_end = tp.split(config.hidden_size)
    vocab_start, vocab_end = tp.split(config.vocab_size)
    held = tp.held_experts(config.num_experts)
    local = {}
    for name, tensor in weights.items():
        if tp.expert_parallel and ".mlp.experts." in name:
            if int(name.split(".mlp.experts.")[1].split(".")[0]) in held:
                local[name] = tensor  # a whole expert
            continue
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            local[name] = tensor[q_rows]
        elif name.endswith("self_attn.sinks"):  # one a query head
            local[name] = tensor[kv_start * group : kv_end * group]
        elif name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            local[name] = tensor[kv_rows]
        elif ".mlp.experts." in name and name.endswith(("gate_proj.weight", "up_proj.weight", "_proj.bias")):
            is_down = name.endswith("down_proj.bias")  # an expert's output columns, as its down rows
            local[name] = tensor[out_start:out_end] if is_down else tensor[expert_start:expert_end]
        elif name.endswith(("o_proj.weight", "o_proj.bias", "down_proj.weight")):
            local[name] = tensor[out_start:out_end]  # output rows, every input column
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            local[name] = tensor[mlp_start:mlp_end]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            local[name] = tensor[vocab_start:vocab_end]
        else:  # norms: every rank needs them whole
            local[name] = tensor
    heads = kv_end - kv_start
    return dataclasses.replace(
        config,
        num_heads=heads * group,
        num_kv_heads=heads,
        intermediate_size=mlp_end - mlp_start,
        expert_intermediate_size=config.expert_intermediate_size if tp.expert_parallel else expert_end - expert_start,
    ), local
