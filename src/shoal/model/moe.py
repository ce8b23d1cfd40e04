"""A sparse layer's MLP: a router picks each token's experts, which run as grouped matrix
multiplies over the rows routed to them, and their outputs are summed by the router's weights.

Invariant (batch invariance): a token's output depends on its own row and the weights only. The
router's logits come from the row-invariant InvariantLinear and its softmax and top-k work per row;
each expert multiplies the rows routed to it with InvariantLinear, whose row bits do not depend on
how many rows share the call; and a row's expert outputs are summed in float32 in the order of its
expert indices, from zero, then rounded once to the model's dtype. So which other rows share an
expert, the batch and chunking change no bit of any row.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from shoal.model.config import LlamaConfig
from shoal.model.invariant_linear import InvariantLinear


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


class MixtureOfExperts:
    """The router (mlp.gate) and the experts (mlp.experts.{e}.gate_proj/up_proj/down_proj) of layer
    `prefix`; `activation` is the experts' gate activation."""

    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        prefix: str,
        tile_rows: int,
        prepack: bool,
        activation: Callable[[torch.Tensor], torch.Tensor],
    ):
        self.config = config
        self.activation = activation
        mlp = prefix + "mlp."
        self.router = InvariantLinear([weights[mlp + "gate.weight"]], None, tile_rows, prepack)
        self.gate_up, self.down = [], []
        for expert in range(config.num_experts):
            e = f"{mlp}experts.{expert}."
            pair = [weights[e + "gate_proj.weight"], weights[e + "up_proj.weight"]]
            self.gate_up.append(InvariantLinear(pair, None, tile_rows, prepack))
            self.down.append(InvariantLinear([weights[e + "down_proj.weight"]], None, tile_rows, prepack))
        # With every matrix on the native kernels, the whole MLP is one C++ call (csrc/moe_cpu.cpp).
        self.kernel = None
        if all(p.backend == "native" for p in (self.router, *self.gate_up, *self.down)):
            self.kernel = torch.classes.shoal.MixtureOfExperts(
                self.router.packed,
                [p.packed for p in self.gate_up],
                [p.packed for p in self.down],
                config.experts_per_token,
                config.expert_routing,
                config.normalize_expert_weights,
                config.mlp_activation == "gelu_tanh",
            )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x: [T, H] (normalised) -> [T, H] in x's dtype."""
        if self.kernel is not None:
            return self.kernel.forward(x.contiguous())
        experts, weights = route(self.router(x), self.config)
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        # Expert by expert in ascending index: each row meets its experts in ascending order.
        for expert in torch.unique(experts).tolist():
            rows, slot = torch.nonzero(experts == expert, as_tuple=True)
            gate, up = self.gate_up[expert](x[rows]).chunk(2, dim=1)
            y = self.down[expert](self.activation(gate) * up)
            out[rows] += weights[rows, slot].unsqueeze(1) * y.float()
        return out.to(x.dtype)
