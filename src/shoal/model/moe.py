"""A sparse layer's MLP: a router picks each token's experts, which run as grouped matrix
multiplies over the rows routed to them, and their outputs are summed by the router's weights.

It runs in three stages, which tensor parallelism gathers between (each rank holding its columns of
every expert's intermediate and of the hidden state): `route` (each row's experts and weights),
`activations` (act(gate) * up of every (row, chosen expert), in rows-by-expert order: expert
ascending, then token ascending) and `combine` (each row's weighted sum of its experts' down
projections). Under expert parallelism a rank holds whole experts instead: `route`, `expert_outputs`
(the outputs of the (row, choice)s of the experts held, zeros elsewhere), summed over the ranks
(each output comes from one rank, x + 0 = x), and `weighted_sum`. With every matrix on the native
kernels the stages are C++ (csrc/moe_cpu.cpp), else torch code computing the same way.

Invariant (batch invariance): a token's output depends on its own row and the weights only. The
router's logits come from the row-invariant matrix multiply and its softmax and top-k work per row;
each expert multiplies the rows routed to it with row-invariant multiplies, whose row bits do not
depend on how many rows share the call; and a row's expert outputs are summed in float32 in the
order of its expert indices, from zero, then rounded once to the model's dtype. So which other rows
share an expert, the batch and chunking change no bit of any row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shoal.model.config import LlamaConfig
from shoal.model.invariant_linear import InvariantLinear
from shoal.model.mlp_gates import GATE_KINDS


def route(logits: torch.Tensor, config: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's experts [T, k] (ascending index) and their weights [T, k] (float32) from the
    router's logits [T, E], by the model's rule (LlamaConfig.expert_routing)."""
    logits, k = logits.float(), config.experts_per_token
    if config.expert_routing == "softmax_topk":
        weights, experts = torch.topk(torch.softmax(logits, dim=-1), k, dim=-1)
    else:
        top, experts = torch.topk(logits, k, dim=-1)
        weights = torch.softmax(top, dim=-1)
    if config.normalize_expert_weights:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    experts, order = experts.sort(dim=-1)
    return experts, weights.gather(1, order)


def rows_by_expert(chosen: torch.Tensor) -> tuple[torch.Tensor, list[tuple[int, int, int]]]:
    """The (token, choice) pairs of `chosen` [T, k] in rows-by-expert order, as flat indices
    (`order`), and each expert with rows as (expert, first place, last place + 1)."""
    order = torch.sort(chosen.flatten(), stable=True).indices
    experts, counts = torch.unique_consecutive(chosen.flatten()[order], return_counts=True)
    spans, start = [], 0
    for expert, count in zip(experts.tolist(), counts.tolist()):
        spans.append((expert, start, start + count))
        start += count
    return order, spans


class MixtureOfExperts:
    """The router (mlp.gate) and the experts (mlp.experts.{e}.gate_proj/up_proj/down_proj) of layer
    `prefix`, as `weights` holds them (a tensor-parallel rank's slices: its columns of each
    expert's intermediate, and its rows of each down projection; an expert-parallel rank's experts
    `held` whole), with their biases where the model has them (LlamaConfig.expert_bias); `gate`
    joins an expert's gate and up projections (mlp_gates)."""

    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        prefix: str,
        tile_rows: int,
        prepack: bool,
        gate: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        held: range | None = None,
    ):
        self.config = config
        self.gate = gate
        self.held = held or range(config.num_experts)
        mlp = prefix + "mlp."
        self.router = InvariantLinear(
            [weights[mlp + "gate.weight"]], [weights.get(mlp + "gate.bias")], tile_rows, prepack
        )
        self.gate_up, self.down = [], []
        for expert in self.held:
            e = f"{mlp}experts.{expert}."
            pair = [weights[e + "gate_proj.weight"], weights[e + "up_proj.weight"]]
            biases = [weights.get(e + "gate_proj.bias"), weights.get(e + "up_proj.bias")]
            self.gate_up.append(InvariantLinear(pair, biases, tile_rows, prepack))
            down = InvariantLinear(
                [weights[e + "down_proj.weight"]], [weights.get(e + "down_proj.bias")], tile_rows, prepack
            )
            self.down.append(down)
        # With every matrix on the native kernels, each stage is one C++ call (csrc/moe_cpu.cpp).
        self.kernel = None
        if all(p.backend == "native" for p in (self.router, *self.gate_up, *self.down)):
            self.kernel = torch.classes.shoal.MixtureOfExperts(
                self.router.packed,
                [p.packed for p in self.gate_up],
                [p.packed for p in self.down],
                self.held.start,
                config.experts_per_token,
                config.expert_routing,
                config.normalize_expert_weights,
                GATE_KINDS[config.mlp_activation],
                config.swiglu_alpha,
                config.swiglu_limit,
            )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] (normalised) -> [T, H] in x's dtype, in one process."""
        x = x.contiguous()
        if self.kernel is not None:
            return self.kernel.forward(x)
        chosen, weights = self.route(x)
        return self.combine(self.activations(x, chosen), chosen, weights)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's experts [T, k] (ascending index) and weights [T, k] (float32)."""
        if self.kernel is not None:
            return self.kernel.route(x.contiguous())
        return route(self.router(x), self.config)

    def activations(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """act(gate) * up of every (row, chosen expert), [T x k, this rank's intermediate columns]
        in rows-by-expert order, in x's dtype."""
        if self.kernel is not None:
            return self.kernel.activations(x.contiguous(), chosen)
        order, spans = rows_by_expert(chosen)
        gathered = x[order // chosen.shape[1]]
        width = self.gate_up[0].out_features // 2
        out = torch.empty(chosen.numel(), width, dtype=x.dtype, device=x.device)
        for expert, start, end in spans:  # every expert is held (tensor parallelism splits them)
            gate, up = self.gate_up[expert](gathered[start:end]).chunk(2, dim=1)
            out[start:end] = self.gate(gate, up)
        return out

    def combine(self, activation: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each row's weighted sum of its experts' down projections, [T, this rank's output
        columns], from the activations of every intermediate column (rows by expert)."""
        if self.kernel is not None:
            return self.kernel.combine(activation.contiguous(), chosen, weights)
        order, spans = rows_by_expert(chosen)
        outputs = self.down[0].out_features
        projected = torch.empty(chosen.numel(), outputs, dtype=activation.dtype, device=activation.device)
        for expert, start, end in spans:
            projected[start:end] = self.down[expert](activation[start:end])
        place = torch.empty_like(order)
        place[order] = torch.arange(order.numel(), device=order.device)
        return self.weighted_sum(projected[place], weights)

    def expert_outputs(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        """The down projection of act(gate) * up of each (row, choice) whose expert is held here,
        [T x k, hidden] in (row, choice) order, in x's dtype; zeros for the others."""
        x = x.contiguous()
        if self.kernel is not None:
            return self.kernel.expert_outputs(x, chosen)
        flat = chosen.flatten()
        out = torch.zeros(flat.numel(), self.down[0].out_features, dtype=x.dtype, device=x.device)
        order, spans = rows_by_expert(chosen)
        for expert, start, end in spans:
            if expert in self.held:
                slots = order[start:end]
                local = expert - self.held.start
                gate, up = self.gate_up[local](x[slots // chosen.shape[1]]).chunk(2, dim=1)
                out[slots] = self.down[local](self.gate(gate, up))
        return out

    def weighted_sum(self, outputs: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Each row's sum of its experts' outputs [T x k, hidden] ((row, choice) order) times their
        weights [T, k]: from zero in float32, in choice order (ascending expert), rounded once."""
        if self.kernel is not None:
            return self.kernel.weighted_sum(outputs.contiguous(), weights)
        by_choice = outputs.float().view(*weights.shape, -1)
        total = torch.zeros(weights.shape[0], by_choice.shape[-1], dtype=torch.float32, device=outputs.device)
        for i in range(weights.shape[1]):  # each row's experts in ascending index
            total += weights[:, i : i + 1] * by_choice[:, i]
        return total.to(outputs.dtype)
