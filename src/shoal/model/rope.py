"""Rotary position embedding (RoPE) with the scaling variants Llama-family checkpoints use."""

from __future__ import annotations

import math

import torch

from shoal.model.config import LlamaConfig, RopeScaling


def inverse_frequencies(head_dim: int, theta: float, scaling: RopeScaling, max_positions: int) -> torch.Tensor:
    """Per-pair inverse frequencies, float32, shape [head_dim // 2], after the configured scaling."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = scaling.rope_type
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling.factor
    if kind == "frequency_factors":
        if len(scaling.frequency_factors) != head_dim // 2:
            raise ValueError(f"{len(scaling.frequency_factors)} RoPE frequency factors for head_dim {head_dim}")
        return inv_freq / torch.tensor(scaling.frequency_factors, dtype=torch.float32)
    if kind == "dynamic":
        # NTK-aware scaling evaluated at the full context length, so positions never depend on batch contents.
        base = theta * (
            (scaling.factor * max_positions / scaling.original_max_position_embeddings) - (scaling.factor - 1)
        ) ** (head_dim / (head_dim - 2))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if kind == "llama3":
        old_context = scaling.original_max_position_embeddings
        low_wavelen = old_context / scaling.low_freq_factor
        high_wavelen = old_context / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_context / wavelen - scaling.low_freq_factor) / (
            scaling.high_freq_factor - scaling.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    if kind == "yarn":
        return yarn_inverse_frequencies(inv_freq, head_dim, theta, scaling)
    raise ValueError(f"unsupported rope scaling type {kind!r}")


def yarn_inverse_frequencies(inv_freq: torch.Tensor, head_dim: int, theta: float, scaling: RopeScaling) -> torch.Tensor:
    """YaRN: pairs that turn fewer than beta_slow times over the original context are interpolated
    (divided by the factor), those that turn more than beta_fast times kept, with a linear ramp
    between (as transformers computes it)."""

    def correction_dim(rotations: float) -> float:
        original = scaling.original_max_position_embeddings
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp
    return inv_freq / scaling.factor * (1 - extrapolated) + inv_freq * extrapolated


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos and sign-folded sin tables indexed by absolute position.

    Uses the Hugging Face half-split layout (rotate_half), which is the layout all loaders produce;
    with partial rotary embeddings, the rotated dimensions are the first rotary_dim / 2 of each half
    (see partial_rotary).
    for_windows: the tables of the sliding-window layers where the model gives them their own base
    (config.window_rope_theta, unscaled).
    """

    def __init__(self, config: LlamaConfig, for_windows: bool = False):
        super().__init__()
        theta, scaling, positions = config.rope_theta, config.rope_scaling, config.max_position_embeddings
        if for_windows and config.window_rope_theta:
            theta, scaling = config.window_rope_theta, RopeScaling()
        scaling = scaling.for_context(positions, positions)
        rotated = config.rotary_dim or config.head_dim
        freqs = torch.outer(
            torch.arange(positions, dtype=torch.float32), inverse_frequencies(rotated, theta, scaling, positions)
        )
        attention = scaling.attention_factor if scaling.attention_factor is not None else 1.0
        # Pairs past the rotated dimensions (partial rotary) turn by nothing: cos 1, sin 0.
        unrotated = (config.head_dim - rotated) // 2
        cos = torch.cat([freqs.cos() * attention, torch.ones(positions, unrotated)], dim=-1)
        sin = torch.cat([freqs.sin() * attention, torch.zeros(positions, unrotated)], dim=-1)
        self.register_buffer("cos", torch.cat([cos, cos], dim=-1), persistent=False)
        # rotate_half(x) * sin == roll(x, D/2) * signed_sin, with the first half of sin negated.
        self.register_buffer("signed_sin", torch.cat([-sin, sin], dim=-1), persistent=False)

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin for the given positions, [T, 1, D] each; computed once per step."""
        return self.cos[positions].unsqueeze(1), self.signed_sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotates x [T, heads, D] by the per-token tables; math in float32, result in x's dtype."""
    xf = x.float()
    return (xf * cos + xf.roll(x.shape[-1] // 2, dims=-1) * signed_sin).to(x.dtype)
