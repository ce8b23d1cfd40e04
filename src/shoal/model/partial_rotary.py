"""Partial rotary embeddings as a reordering of head dimensions, done once at load time.

A model with partial RoPE (Phi-4-mini: rotary_dim of each head's dimensions) rotates pairs (i,
i + rotary_dim / 2) for i < rotary_dim / 2 and leaves the rest of the head as it is. The decoder
rotates pairs (i, i + head_dim / 2) of every head. Moving each head's rotated halves to the front of
the decoder's two halves, and the unrotated dimensions behind them, in the rows of q_proj and k_proj
alike, turns the one into the other: the RoPE tables turn the unrotated pairs by nothing (cos 1, sin
0, exact), and q . k is the same sum over the same products in another order of dimensions, which
the attention kernels add in their own fixed order anyway. Values and o_proj are untouched.
"""

from __future__ import annotations

import torch

from shoal.model.config import LlamaConfig
from shoal.model.quantized_weight import QuantizedWeight

Weight = torch.Tensor | QuantizedWeight


def decoder_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The checkpoint dimension at each of the decoder's positions in a head: the first rotated
    half, the unrotated dimensions' first half, the second rotated half, then the rest."""
    half, rotated_half = head_dim // 2, rotary_dim // 2
    unrotated = list(range(rotary_dim, head_dim))
    split = half - rotated_half
    order = [*range(rotated_half), *unrotated[:split], *range(rotated_half, rotary_dim), *unrotated[split:]]
    return torch.tensor(order)


def gather_rotary_dims(weights: dict[str, Weight], config: LlamaConfig) -> dict[str, Weight]:
    """`weights` with the rows of every q_proj and k_proj (and their biases) in the decoder's order of
    head dimensions; the same dict where every dimension is rotated."""
    if not config.rotary_dim or config.rotary_dim == config.head_dim:
        return weights
    if config.qk_norm == "projection":
        raise ValueError("partial rotary embeddings with q/k norms over whole projections are not supported")
    order = decoder_order(config.head_dim, config.rotary_dim)
    gathered = dict(weights)
    for name, weight in weights.items():
        kind = name.rsplit(".", 2)[-2] if name.startswith("model.layers.") else ""
        if kind in ("q_proj", "k_proj"):
            heads = weight.shape[0] // config.head_dim
            rows = (torch.arange(heads).unsqueeze(1) * config.head_dim + order).reshape(-1)
            gathered[name] = weight[rows]
        elif kind in ("q_norm", "k_norm") and config.qk_norm == "head":
            gathered[name] = weight[order]
    return gathered
