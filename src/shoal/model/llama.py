"""The Llama-family decoder (SmolLM2, TinyLlama, Llama 2/3, Qwen2, Mistral) over a paged KV cache.

Weights use Hugging Face names and layout. Unless prepacked for the CPU's GEMM kernels they are
referenced, not copied, so memory-mapped cache files stay shared between processes. A model object
may hold a contiguous range of layers (a pipeline stage) and, within it, one rank's shard
(tensor parallelism); a sharded layer's pieces meet in explicit gathers (see sharding).

Two ways run a layer, each batch invariant. On CPUs with the native kernels and prepacked weights,
each layer is one C++ object (`torch.classes.shoal.DecoderLayer`, csrc/decoder_layer_cpu.cpp): one
call per layer, or four with gathers between them under tensor parallelism, which compute the same
bits. Elsewhere (CUDA, weights shared between processes, no compiler) the layer is the torch code
below, with every matrix multiply through `InvariantLinear` and attention through the tiled torch
kernel or the C++ row kernel. Either way a token's hidden states never depend on its batch.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch

from shoal.model.config import LlamaConfig
from shoal.model.cpu_attention import row_paged_attention
from shoal.model.invariant_linear import InvariantLinear
from shoal.model.kv_groups import KVGroups
from shoal.model.layout import layer_norms
from shoal.model.lora_batch import LoraBatch
from shoal.model.mlp_gates import GATE_KINDS, gate_function
from shoal.model.moe import MixtureOfExperts
from shoal.model.native_kernels import load_native_kernels
from shoal.model.paged_attention import AttentionMetadata, allocate_kv_cache, tiled_paged_attention, write_kv
from shoal.model.quantized_weight import QuantizedWeight
from shoal.model.rope import RotaryEmbedding, apply_rotary
from shoal.model.sharding import TensorParallel, projection_widths, shard_weights

KVCache = tuple[torch.Tensor, torch.Tensor]
log = logging.getLogger(__name__)

AttentionKernel = Callable[
    [torch.Tensor, KVCache, AttentionMetadata, float, int, float, torch.Tensor | None], torch.Tensor
]


def kv_bytes_per_token_per_layer(config: LlamaConfig, bytes_per_value: int) -> int:
    """One layer's KV cache per token: keys and values of every KV head (values carry a ones column)."""
    return config.num_kv_heads * (2 * config.head_dim + 1) * bytes_per_value


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm: normalised in float32, scaled in the weight dtype (as transformers does)."""
    return weight * torch.rms_norm(x.float(), x.shape[-1:], eps=eps).to(weight.dtype)


# No adapted rows, and their (no) deltas: the native layer's parts then compute what its one call does.
_NO_ROWS = torch.empty(0, dtype=torch.long)
_NO_DELTAS = torch.empty(0, 0)


def _with_deltas(part: torch.Tensor, rows: torch.Tensor, deltas: torch.Tensor) -> torch.Tensor:
    """A projection's output with the rows `rows` plus their float32 deltas, rounded to its dtype
    (as the native layer adds them)."""
    if rows.numel() == 0:
        return part
    return part.index_copy(0, rows, (part.index_select(0, rows).float() + deltas).to(part.dtype))


class DecoderLayer:
    """One attention + SwiGLU MLP block, with q/k/v and gate/up each fused into one projection.
    `config` has this rank's head and intermediate counts, `model_config` the whole model's; with
    `tensor_parallel`, the inputs and outputs of o_proj and down_proj are gathered from all ranks."""

    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        prefix: str,
        tile_rows: int,
        prepack: bool,
        attention: AttentionKernel,
        model_config: LlamaConfig,
        tensor_parallel: TensorParallel | None,
        rope: RotaryEmbedding,
        fuse: bool,
        window: int,
        rotary: bool,
        sparse: bool,
        index: int,
    ):
        """fuse: run the layer as one native object when its projections are all native; window: its
        attention's sliding window, 0 for none; rotary: whether it applies RoPE; sparse: whether its
        MLP is a mixture of experts (moe.MixtureOfExperts), which the native object leaves to the
        experts' own native kernel; index: the layer's number in the model (adapters' weights are
        by it)."""
        self.config = config
        self.index = index
        self.attention = attention
        self.rope = rope
        self.window = window
        self.rotary = rotary
        self.tensor_parallel = tensor_parallel
        # (units, columns per unit) of each gathered activation: whole KV-head groups, or columns.
        self.gather_shapes = {
            "heads": (model_config.num_kv_heads, model_config.num_queries_per_kv * model_config.head_dim),
            "intermediate": (model_config.intermediate_size, 1),
            "expert_intermediate": (model_config.expert_intermediate_size, 1),
            "hidden": (model_config.hidden_size, 1),
        }
        attn = prefix + "self_attn."
        self.qkv = InvariantLinear(
            [weights[f"{attn}{p}_proj.weight"] for p in "qkv"],
            [weights.get(f"{attn}{p}_proj.bias") for p in "qkv"],
            tile_rows,
            prepack,
        )
        self.o = InvariantLinear(
            [weights[attn + "o_proj.weight"]], [weights.get(attn + "o_proj.bias")], tile_rows, prepack
        )
        self.gate = gate_function(config)
        self.experts = None
        if sparse:
            experts = tensor_parallel is not None and tensor_parallel.expert_parallel
            held = tensor_parallel.held_experts(config.num_experts) if experts else None
            self.experts = MixtureOfExperts(config, weights, prefix, tile_rows, prepack, self.gate, held)
        else:
            self.gate_up = InvariantLinear(
                [weights[prefix + "mlp.gate_proj.weight"], weights[prefix + "mlp.up_proj.weight"]],
                None,
                tile_rows,
                prepack,
            )
            self.down = InvariantLinear([weights[prefix + "mlp.down_proj.weight"]], None, tile_rows, prepack)
        norms = layer_norms(config)

        def norm(name: str | None) -> torch.Tensor | None:
            return weights[f"{prefix}{name}.weight"] if name else None

        self.before_attention, self.after_attention = norm(norms.before_attention), norm(norms.after_attention)
        self.before_mlp, self.after_mlp = norm(norms.before_mlp), norm(norms.after_mlp)
        self.norms = (self.before_attention, self.after_attention, self.before_mlp, self.after_mlp)
        self.qk_norms = (weights[attn + "q_norm.weight"], weights[attn + "k_norm.weight"]) if config.qk_norm else None
        # gpt-oss: each head's attention-sink logit, in float32 whatever the weights' dtype.
        self.sinks = weights[attn + "sinks"].float().contiguous() if config.attention_sinks else None
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.attention_scale
        self.native = None
        mlp = [] if sparse else [self.gate_up, self.down]
        mlp_native = self.experts.kernel is not None if sparse else all(p.backend == "native" for p in mlp)
        if fuse and mlp_native and all(p.backend == "native" for p in (self.qkv, self.o)):
            none = torch.empty(0)
            self.native = torch.classes.shoal.DecoderLayer(
                self.qkv.packed,
                self.o.packed,
                [p.packed for p in mlp],
                [none if n is None else n for n in self.norms],
                rope.cos,
                rope.signed_sin,
                config.num_heads,
                config.num_kv_heads,
                config.head_dim,
                config.rms_norm_eps,
                window,
                *(self.qk_norms or (none, none)),
                rotary,
                self.scale,
                config.attention_softcap,
                torch.empty(0) if self.sinks is None else self.sinks,
                GATE_KINDS[config.mlp_activation],
                config.swiglu_alpha,
                config.swiglu_limit,
                config.residual_multiplier,
            )
        # This rank's columns of the hidden state (the outputs of its o_proj and down_proj).
        self.hidden_columns = slice(*tensor_parallel.split(model_config.hidden_size)) if tensor_parallel else None

    def forward(
        self,
        hidden: torch.Tensor,
        rope_tables: tuple[torch.Tensor, torch.Tensor],
        cache: KVCache,
        meta: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """`lora`: the step's adapted rows (model.lora_batch), each projection's delta added to theirs."""
        if lora is not None and self.experts is not None:
            raise ValueError("LoRA adapters run on dense layers (not a mixture of experts)")
        if self.native is not None:
            return self._native_forward(hidden, cache, meta, lora)
        cfg, eps = self.config, self.config.rms_norm_eps
        tokens = hidden.shape[0]
        normed = self._normed(hidden, self.before_attention)
        qkv = self._adapted(self.qkv(normed), lora, "qkv", normed)
        qk = qkv[:, : self.q_size + self.kv_size]
        if self.qk_norms is not None:
            q_norm, k_norm = self.qk_norms
            # Per head: over [T, heads, D] views; over the projection: over [T, heads * D].
            unit = (-1, cfg.head_dim) if cfg.qk_norm == "head" else (-1,)
            q, k = qk.split([self.q_size, self.kv_size], dim=1)
            q, k = rms_norm(q.reshape(tokens, *unit), q_norm, eps), rms_norm(k.reshape(tokens, *unit), k_norm, eps)
            qk = torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1)], dim=1)
        # q and k are rotated together: one pass over the [T, H + Hkv, D] view.
        qk = qk.reshape(tokens, -1, cfg.head_dim)
        if self.rotary:
            qk = apply_rotary(qk, *rope_tables)
        q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].reshape(tokens, cfg.num_kv_heads, cfg.head_dim)
        write_kv(cache, k, v, meta)
        attended = self.attention(q, cache, meta, self.scale, self.window, cfg.attention_softcap, self.sinks)
        heads = self._gathered(attended, "heads")
        output = self._adapted(self.o(heads), lora, "o_proj", heads)
        hidden = hidden + self._joining(self._gathered(output, "hidden"), self.after_attention)
        normed = self._normed(hidden, self.before_mlp)
        if self.experts is not None:
            part = self._experts_part(normed)
            if self.tensor_parallel is not None and not self.tensor_parallel.expert_parallel:
                part = self._gathered(part, "hidden")
            return hidden + self._joining(part, self.after_mlp)
        gate, up = self._adapted(self.gate_up(normed), lora, "gate_up", normed).chunk(2, dim=1)
        activation = self._gathered(self.gate(gate, up), "intermediate")
        down = self._adapted(self.down(activation), lora, "down_proj", activation)
        return hidden + self._joining(self._gathered(down, "hidden"), self.after_mlp)

    def _adapted(self, output: torch.Tensor, lora: LoraBatch | None, projection: str, x: torch.Tensor) -> torch.Tensor:
        """A projection's output with the adapted rows' deltas added (rounded to its dtype)."""
        if lora is None:
            return output
        return _with_deltas(output, lora.rows, lora.deltas(self.index, projection, lora.picked(x)))

    def _normed(self, hidden: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """An attention or MLP input: normalised where the model has a norm before it."""
        return hidden if norm is None else rms_norm(hidden, norm, self.config.rms_norm_eps)

    def _joining(self, output: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
        """An attention or MLP output as it joins the residual stream: normalised where the model
        has a norm after it, and times Granite's residual multiplier."""
        output = self._normed(output, norm)
        multiplier = self.config.residual_multiplier
        return output if multiplier == 1.0 else output * multiplier

    @staticmethod
    def _native_layout(cache: KVCache, meta: AttentionMetadata) -> tuple:
        """The caches and the step's metadata as the native layer's attention takes them."""
        return (*cache, meta.token_positions, meta.slot_rows, meta.block_tables, meta.token_sequences)

    def _native_forward(
        self, hidden: torch.Tensor, cache: KVCache, meta: AttentionMetadata, lora: LoraBatch | None = None
    ) -> torch.Tensor:
        """The native layer: in one call, or in its parts with gathers between them (tensor
        parallelism), the experts between them, or the adapted rows' deltas handed to each part (the
        other rows computed exactly as the one call computes them)."""
        layout = self._native_layout(cache, meta)
        if self.tensor_parallel is None and self.experts is None and lora is None:
            return self.native.forward(hidden, *layout)
        native, columns, eps = self.native, self.hidden_columns, self.config.rms_norm_eps
        rows = lora.rows if lora is not None else _NO_ROWS

        def delta(projection: str, inputs: Callable[[], torch.Tensor]) -> torch.Tensor:
            """The adapted rows' deltas of a projection, from their inputs; empty without LoRA."""
            return lora.deltas(self.index, projection, inputs()) if lora is not None else _NO_DELTAS

        def normed_rows(x: torch.Tensor, norm: torch.Tensor | None) -> torch.Tensor:
            picked = lora.picked(x)
            return picked if norm is None else torch.ops.shoal.rms_norm_rows(picked, norm, eps)

        qkv_delta = delta("qkv", lambda: normed_rows(hidden, self.before_attention))
        heads = self._gathered(native.attention_with_deltas(hidden, *layout, rows, qkv_delta), "heads")
        o_delta = delta("o_proj", lambda: lora.picked(heads))
        if self.tensor_parallel is None:
            hidden = native.output_with_deltas(heads, hidden, rows, o_delta)
        elif self.config.norms_after:  # normalised over whole rows: gathered, then joined
            part = _with_deltas(native.project_output(heads), rows, o_delta)
            hidden = native.join_attention(self._gathered(part, "hidden"), hidden)
        else:
            hidden = self._gathered(native.output_with_deltas(heads, hidden[:, columns], rows, o_delta), "hidden")
        if self.experts is not None:
            normed = hidden
            if self.before_mlp is not None:
                normed = torch.ops.shoal.rms_norm_rows(hidden, self.before_mlp, eps)
            part = self._experts_part(normed)
            if self.tensor_parallel is None or self.tensor_parallel.expert_parallel:  # whole rows
                return native.join_mlp(part, hidden)
            if self.config.norms_after:
                return native.join_mlp(self._gathered(part, "hidden"), hidden)
            return self._gathered(native.join_mlp(part, hidden[:, columns]), "hidden")
        gate_up_delta = delta("gate_up", lambda: normed_rows(hidden, self.before_mlp))
        activation = self._gathered(native.mlp_with_deltas(hidden, rows, gate_up_delta), "intermediate")
        down_delta = delta("down_proj", lambda: lora.picked(activation))
        if self.tensor_parallel is None:
            return native.down_with_deltas(activation, hidden, rows, down_delta)
        if self.config.norms_after:
            part = _with_deltas(native.project_down(activation), rows, down_delta)
            return native.join_mlp(self._gathered(part, "hidden"), hidden)
        return self._gathered(native.down_with_deltas(activation, hidden[:, columns], rows, down_delta), "hidden")

    def _experts_part(self, normed: torch.Tensor) -> torch.Tensor:
        """The mixture's output for this rank's columns of the hidden state (all of them without
        tensor parallelism, and under expert parallelism), from the normalised MLP input: routed,
        each expert's activation gathered from every rank, then combined; or, under expert
        parallelism, the held experts' outputs summed over the ranks, then weighted."""
        if self.tensor_parallel is None:
            return self.experts(normed)
        chosen, weights = self.experts.route(normed)
        if self.tensor_parallel.expert_parallel:
            outputs = self.tensor_parallel.all_sum(self.experts.expert_outputs(normed, chosen))
            return self.experts.weighted_sum(outputs, weights)
        activation = self._gathered(self.experts.activations(normed, chosen), "expert_intermediate")
        return self.experts.combine(activation, chosen, weights)

    def _gathered(self, part: torch.Tensor, columns: str) -> torch.Tensor:
        """This rank's columns of an activation joined with every other rank's (itself without TP)."""
        if self.tensor_parallel is None:
            return part
        return self.tensor_parallel.all_gather_columns(part, *self.gather_shapes[columns])


class LlamaModel:
    """Decoder layers `layers` (default: all) with the embedding when they start at layer 0 and
    the final norm + LM head when they end at the last layer; with `tensor_parallel`, this rank's
    shard of them. `config` is this rank's view (its head and intermediate counts; vocabulary and
    layer count stay the model's). Invariant: weights are not modified; caches are owned by the
    caller, one per KV slot its layers use (`kv_slots`; shoal.model.kv_groups): layer i keeps its KV
    in slot kv_groups.place(i)[1] of the blocks of its group's tables."""

    def __init__(
        self,
        config: LlamaConfig,
        weights: dict[str, torch.Tensor],
        tile_rows: int,
        device: torch.device | str = "cpu",
        prepack: bool = False,
        attention_kernel: str = "auto",
        layers: range | None = None,
        tensor_parallel: TensorParallel | None = None,
        kv_groups: KVGroups | None = None,
    ):
        self.layer_range = layers or range(config.num_layers)
        self.kv_groups = kv_groups or KVGroups.of(config)
        places = [self.kv_groups.place(i) for i in self.layer_range]
        self.kv_slots = sorted({slot for _, slot in places})
        # Each held layer's (group, index into the caches of kv_slots).
        self.layer_caches = [(group, self.kv_slots.index(slot)) for group, slot in places]
        self.has_embedding = self.layer_range.start == 0
        self.has_head = self.layer_range.stop == config.num_layers
        self.tensor_parallel = tensor_parallel
        # Each dense projection's output columns here: what a LoRA delta of it is wide.
        self.lora_widths = projection_widths(config, tensor_parallel)
        wanted = [f"model.layers.{i}." for i in self.layer_range]
        weights = {
            name: t
            for name, t in weights.items()
            if not name.startswith("model.layers.") or name.startswith(tuple(wanted))
        }
        model_config = config
        if tensor_parallel is not None:
            config, weights = shard_weights(config, weights, tensor_parallel)
        self.config = config
        self.device = torch.device(device)
        self.vocab_range = tensor_parallel.split(config.vocab_size) if tensor_parallel else (0, config.vocab_size)
        embed = weights["model.embed_tokens.weight"]
        self.dtype = weights["model.norm.weight"].dtype
        self.embed = embed.to(self.device) if self.has_embedding else None
        self.norm = weights["model.norm.weight"].to(self.device)
        lm_head = embed if config.tie_word_embeddings else weights.get("lm_head.weight")
        self.lm_head = InvariantLinear([lm_head.to(self.device)], None, tile_rows, prepack) if self.has_head else None
        attention = self._pick_attention(attention_kernel)
        self.attention_uses_tiles = attention is tiled_paged_attention
        self.rope = RotaryEmbedding(config).to(self.device)
        # Gemma 3's local layers rotate by a base of their own.
        self.window_rope = (
            RotaryEmbedding(config, for_windows=True).to(self.device) if config.window_rope_theta else None
        )
        on_device = {name: t.to(self.device) for name, t in weights.items() if name.startswith(tuple(wanted))}
        self.layers = [
            DecoderLayer(
                config,
                on_device,
                f"model.layers.{i}.",
                tile_rows,
                prepack,
                attention,
                model_config,
                tensor_parallel,
                self.window_rope if self.window_rope is not None and config.window(i) else self.rope,
                fuse=not self.attention_uses_tiles,
                window=config.window(i),
                rotary=config.rotary(i),
                sparse=config.sparse(i),
                index=i,
            )
            for i in self.layer_range
        ]
        self.native_norm = self.lm_head is not None and self.lm_head.backend == "native"
        unfused = sum(layer.native is None for layer in self.layers)
        if unfused and not self.attention_uses_tiles:
            log.info(
                "%s: %d of %d layers run the torch path (a projection without a native kernel)",
                config.architecture,
                unfused,
                len(self.layers),
            )

    def _pick_attention(self, kind: str) -> AttentionKernel:
        """ "rows": the C++ CPU kernel; "tiles": the torch kernel; "auto": rows on CPU when it builds."""
        if kind not in ("auto", "rows", "tiles"):
            raise ValueError(f"attention_kernel must be auto, rows or tiles, got {kind!r}")
        kernel = load_native_kernels() if kind != "tiles" and self.device.type == "cpu" else None
        if kernel is None:
            if kind == "rows":
                raise RuntimeError("the rows attention kernel needs a CPU device and a C++ compiler")
            return tiled_paged_attention
        return functools.partial(row_paged_attention, kernel)

    @torch.inference_mode()
    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] token ids -> [T, H] embeddings (each rank looks up its part of the vocabulary)."""
        if self.tensor_parallel is None:
            return self._embedding_rows(input_ids)
        start, end = self.vocab_range
        mine = (input_ids >= start) & (input_ids < end)
        rows = self._embedding_rows((input_ids - start).clamp(0, end - start - 1)) * mine.unsqueeze(1).to(self.dtype)
        return self.tensor_parallel.all_sum(rows)

    def _embedding_rows(self, ids: torch.Tensor) -> torch.Tensor:
        rows = self.embed[ids]
        return rows.dequantize().to(self.device, self.dtype) if isinstance(rows, QuantizedWeight) else rows

    @torch.inference_mode()
    def forward(
        self,
        inputs: torch.Tensor,
        positions: torch.Tensor,
        caches: list[KVCache],
        metas: list[AttentionMetadata],
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """inputs: [T] token ids if this holds the embedding, else [T, H] hidden states from the
        previous layers; positions: [T]; metas: the step's attention metadata of each KV group;
        lora: the rows that run LoRA adapters, and theirs.
        Writes the tokens' K/V into `caches` (those of kv_slots); returns the hidden states [T, H]
        after the last layer held (not normalised: see compute_logits)."""
        if self.has_embedding:
            hidden = self.embed_tokens(inputs)
            if self.config.embedding_multiplier != 1.0:
                hidden = hidden * self.config.embedding_multiplier
        else:
            hidden = inputs.to(self.dtype)
        tables = {id(self.rope): self.rope.tables(positions)}
        if self.window_rope is not None:
            tables[id(self.window_rope)] = self.window_rope.tables(positions)
        for layer, (group, cache) in zip(self.layers, self.layer_caches):
            hidden = layer.forward(hidden, tables[id(layer.rope)], caches[cache], metas[group], lora)
        return hidden

    @torch.inference_mode()
    def final_norm(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's hidden states [N, H] through the model's final norm (what transformers
        calls the last hidden state)."""
        eps = self.config.rms_norm_eps
        if self.native_norm:
            return torch.ops.shoal.rms_norm_rows(hidden, self.norm, eps)
        return rms_norm(hidden, self.norm, eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits [N, vocab] from the last layer's hidden states (final norm, then LM head)."""
        logits = self.lm_head(self.final_norm(hidden)).float()
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        if self.config.logit_softcap:
            cap = self.config.logit_softcap
            logits = torch.tanh(logits / cap) * cap
        if self.tensor_parallel is None:
            return logits
        return self.tensor_parallel.all_gather_columns(logits, self.config.vocab_size)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> list[KVCache]:
        """The caches of kv_slots, each of `num_blocks` blocks."""
        cfg = self.config
        return [
            allocate_kv_cache(num_blocks, cfg.num_kv_heads, block_size, cfg.head_dim, self.dtype, self.device)
            for _ in self.kv_slots
        ]

    def kv_bytes_per_block_token(self) -> int:
        """KV-cache bytes a block holds per token, here: its slots' layers and heads held here."""
        return len(self.kv_slots) * kv_bytes_per_token_per_layer(self.config, torch.finfo(self.dtype).bits // 8)
