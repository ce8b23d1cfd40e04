"""Architecture description of a Llama-family decoder, independent of where the weights come from."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as in Hugging Face's `rope_scaling` (types: linear, llama3, dynamic,
    longrope, yarn), or per-pair divisors of the inverse frequencies (type frequency_factors: a GGUF file's
    rope_freqs tensor, which llama.cpp's converter writes for Llama 3.1+ scaling, or longrope's
    factors once the context is known). attention_factor multiplies cos and sin (longrope's; None:
    derived from the context as transformers does)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    frequency_factors: tuple[float, ...] = ()
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float | None = None
    # YaRN's ramp between interpolated and extrapolated pairs, and its attention factor's inputs.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True

    @classmethod
    def from_hf(cls, raw: dict[str, Any] | None, original_max_positions: int | None = None) -> RopeScaling:
        """Raises ValueError for a type shoal does not compute (yarn, ...), rather than rotating by
        other frequencies than the model's. original_max_positions: config.json's top-level
        `original_max_position_embeddings` (Phi-3 states it there)."""
        if not raw:
            return cls()
        rope_type = raw.get("rope_type", raw.get("type", "default"))
        if rope_type not in ("default", "linear", "llama3", "dynamic", "longrope", "yarn"):
            raise ValueError(f"rope scaling type {rope_type!r} is not supported")
        known = {f.name for f in dataclasses.fields(cls)}
        kwargs = {k: v for k, v in raw.items() if k in known}
        kwargs["rope_type"] = rope_type
        if rope_type == "yarn":
            kwargs = {k: v for k, v in kwargs.items() if v is not None}  # unset keys take the defaults
            kwargs.setdefault("original_max_position_embeddings", original_max_positions)
            if kwargs.get("original_max_position_embeddings") is None:
                raise ValueError("yarn needs original_max_position_embeddings")
        if rope_type == "longrope":
            kwargs["short_factor"], kwargs["long_factor"] = tuple(raw["short_factor"]), tuple(raw["long_factor"])
            kwargs.setdefault("original_max_position_embeddings", original_max_positions)
            if kwargs["original_max_position_embeddings"] is None:
                raise ValueError("longrope needs original_max_position_embeddings")
        return cls(**kwargs)

    def for_context(self, positions: int, model_positions: int) -> RopeScaling:
        """This scaling for a context of `positions` tokens, of a model trained for `model_positions`:
        longrope becomes its long factors where the context passes the original length, else its short
        ones (llama.cpp's rule; fixed per engine, so a token's rotation never depends on its batch or
        sequence length), with its attention factor; yarn gets its attention factor (from its factor,
        and mscale over mscale_all_dim where both are given, as transformers derives it); any other
        type stays as it is."""
        if self.rope_type == "yarn" and self.attention_factor is None:

            def mscale(scale: float, weight: float = 1.0) -> float:
                return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

            weighted = self.mscale and self.mscale_all_dim
            factor = mscale(self.factor, self.mscale) / mscale(self.factor, self.mscale_all_dim) if weighted else None
            return dataclasses.replace(self, attention_factor=factor if weighted else mscale(self.factor))
        if self.rope_type != "longrope":
            return self
        original = self.original_max_position_embeddings
        attention = self.attention_factor
        if attention is None:
            scale = model_positions / original
            attention = 1.0 if scale <= 1.0 else math.sqrt(1 + math.log(scale) / math.log(original))
        factors = self.long_factor if positions > original else self.short_factor
        return RopeScaling(
            rope_type="frequency_factors",
            original_max_position_embeddings=original,
            frequency_factors=factors,
            attention_factor=attention,
        )


@dataclass(frozen=True)
class LlamaConfig:
    """Shapes and numerics of one model. Invariant: num_heads is a multiple of num_kv_heads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    # The leading dimensions of each head that RoPE rotates (partial rotary embeddings: Phi-4-mini);
    # 0: all of them. The loaders gather them into the pairs the decoder rotates (partial_rotary).
    rotary_dim: int = 0
    attention_bias: bool = False
    # RMSNorm of the queries and keys before RoPE: "head" per head, weights q_norm and k_norm [head_dim]
    # (Qwen3); "projection" over each whole projection, [heads * head_dim] (OLMo 2); "" none.
    qk_norm: str = ""
    # Where the layer's RMSNorms sit (layout.layer_norm_names): before attention and the MLP (Llama),
    # after them, on their outputs before the residual add (OLMo 2), or both (Gemma).
    norms_before: bool = True
    norms_after: bool = False
    # The MLP's gate activation: "silu" (SwiGLU), "gelu_tanh" (GeGLU, GELU's tanh approximation) or
    # "swiglu_clamped" (gpt-oss: swiglu_alpha and swiglu_limit; see mlp_gates).
    mlp_activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    # gpt-oss: each head has an attention-sink logit (self_attn.sinks), a term of the softmax's sum
    # without a value.
    attention_sinks: bool = False
    # Gemma 2's soft caps: scores and logits become cap * tanh(x / cap); 0 for none.
    attention_softcap: float = 0.0
    logit_softcap: float = 0.0
    # The RoPE base of the sliding-window layers (Gemma 3's local layers, without scaling); 0: those
    # layers rotate as the others do.
    window_rope_theta: float = 0.0
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "llama"  # the model family's name (shoal.model.families)
    # Each layer's sliding window (the keys a token sees, itself included), 0 for full attention;
    # empty: every layer full.
    attention_windows: tuple[int, ...] = ()
    # Whether each layer applies RoPE (SmolLM3 leaves it out of some); empty: every layer does.
    rotary_layers: tuple[bool, ...] = ()
    # Granite's multipliers: of the embeddings, of each attention and MLP output before it joins the
    # residual stream, the attention's score scale (None: head_dim ** -0.5), and the logits' divisor.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    attention_multiplier: float | None = None
    logits_scaling: float = 1.0
    # Mixture of experts (0 experts: every layer's MLP is dense). A sparse layer's router scores its
    # experts, each token runs the experts_per_token best and sums their outputs by their weights:
    # expert_routing "softmax_topk" (softmax over all experts, then the best k; Mixtral, Qwen3-MoE) or
    # "topk_softmax" (the best k logits, then softmax over them), the k weights then divided by
    # their sum where normalize_expert_weights. Experts are SwiGLU MLPs of expert_intermediate_size.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0
    expert_routing: str = "softmax_topk"
    normalize_expert_weights: bool = False
    # The router and each expert's projections carry biases (gpt-oss).
    expert_bias: bool = False
    # Which layers are sparse when num_experts > 0; empty: all of them (others keep a dense MLP of
    # intermediate_size).
    sparse_layers: tuple[bool, ...] = ()

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}")
        if self.attention_windows and len(self.attention_windows) != self.num_layers:
            raise ValueError(f"{len(self.attention_windows)} attention windows for {self.num_layers} layers")
        if any(window < 0 for window in self.attention_windows):
            raise ValueError(f"attention windows must be 0 (full) or positive: {self.attention_windows}")
        if self.qk_norm not in ("", "head", "projection"):
            raise ValueError(f"qk_norm must be '', 'head' or 'projection', not {self.qk_norm!r}")
        if self.rotary_layers and len(self.rotary_layers) != self.num_layers:
            raise ValueError(f"{len(self.rotary_layers)} rotary flags for {self.num_layers} layers")
        if self.rotary_dim and (self.rotary_dim % 2 or self.rotary_dim > self.head_dim):
            raise ValueError(f"rotary_dim {self.rotary_dim} must be even and at most head_dim {self.head_dim}")
        if not (self.norms_before or self.norms_after):
            raise ValueError("a layer needs its norms before or after attention and the MLP")
        if self.mlp_activation not in ("silu", "gelu_tanh", "swiglu_clamped"):
            raise ValueError(
                f"mlp_activation must be 'silu', 'gelu_tanh' or 'swiglu_clamped', not {self.mlp_activation!r}"
            )
        if self.attention_softcap < 0 or self.logit_softcap < 0:
            raise ValueError("soft caps must be 0 (none) or positive")
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token {self.experts_per_token} must be 1 to num_experts {self.num_experts}")
        if self.num_experts and self.expert_intermediate_size <= 0:
            raise ValueError("a mixture of experts needs expert_intermediate_size")
        if self.expert_routing not in ("softmax_topk", "topk_softmax"):
            raise ValueError(f"expert_routing must be 'softmax_topk' or 'topk_softmax', not {self.expert_routing!r}")
        if self.sparse_layers and len(self.sparse_layers) != self.num_layers:
            raise ValueError(f"{len(self.sparse_layers)} sparse-layer flags for {self.num_layers} layers")
        if len(set(self.attention_windows) - {0}) > 1:
            raise ValueError(f"one sliding window size per model, not {sorted(set(self.attention_windows) - {0})}")

    @property
    def sliding_window(self) -> int:
        """The window of the model's windowed layers, 0 if none has one."""
        return max(self.attention_windows, default=0)

    @property
    def attention_scale(self) -> float:
        """What attention scores are multiplied by."""
        return self.attention_multiplier if self.attention_multiplier is not None else self.head_dim**-0.5

    def rotary(self, layer: int) -> bool:
        """Whether layer `layer` applies RoPE to its queries and keys."""
        return self.rotary_layers[layer] if self.rotary_layers else True

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and (self.sparse_layers[layer] if self.sparse_layers else True)

    def window(self, layer: int) -> int:
        """Layer `layer`'s sliding window, 0 for full attention."""
        return self.attention_windows[layer] if self.attention_windows else 0

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads
