"""Reads a llama.cpp GGUF file into a `LlamaConfig` and a state dict in Hugging Face naming and layout.

Invariants of the produced state dict: tensors are dequantized to the requested dtype (or, when asked,
matrices in a type the native kernels run, quantized_weight.GGML_TYPES, stay QuantizedWeight blocks),
shaped in torch order (ggml lists dimensions innermost first, torch outermost first), and
q_proj/k_proj rows are in the Hugging Face order, i.e. llama.cpp's rotary permutation of llama-arch
checkpoints is undone.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch
from gguf import GGUFReader, GGUFValueType
from gguf.gguf_reader import ReaderField, ReaderTensor

from shoal.model.config import LlamaConfig, RopeScaling
from shoal.model.errors import ModelLoadError
from shoal.model.families import family_named, family_of_gguf_architecture
from shoal.model.families.family import Family
from shoal.model.gguf_header import read_gguf_header
from shoal.model.layout import check_state_dict
from shoal.model.quantized_weight import GGML_TYPES, QuantizedWeight

log = logging.getLogger(__name__)


_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    # Every expert's matrices in one 3-D tensor, split by expert when loaded (split_experts).
    "ffn_gate_exps.weight": "mlp.experts.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.down_proj.weight",
}
_STACKED_EXPERTS = ".mlp.experts."


def open_gguf(path: str | Path) -> GGUFReader:
    """Opens (memory-maps) a GGUF file; a missing, malformed or truncated file raises ModelLoadError
    naming the file and what is wrong (its header is scanned first: gguf's reader fails on a cut file
    with an IndexError or a reshape message)."""
    try:
        data_end = read_gguf_header(path).data_end
        size = Path(path).stat().st_size
    except OSError as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    if size < data_end:
        raise ModelLoadError(
            f"GGUF file {path} is truncated: its tensors end at byte {data_end:,}, the file has {size:,}"
        )
    try:
        return GGUFReader(str(path), "r")
    except (OSError, ValueError, IndexError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc


def _field_value(field: ReaderField) -> Any:
    """One metadata value as plain Python: int/float/bool/str, or a list of those for arrays."""
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        parts = [field.parts[i] for i in field.data]
        if field.types[-1] == GGUFValueType.STRING:
            return [bytes(part).decode("utf-8") for part in parts]
        return [part[0].item() for part in parts]
    part = field.parts[field.data[0]]
    return bytes(part).decode("utf-8") if kind == GGUFValueType.STRING else part[0].item()


def gguf_metadata(reader: GGUFReader) -> dict[str, Any]:
    """All key/value metadata as plain Python values, except the GGUF.* header fields and nested arrays
    (which no key read here uses)."""
    metadata: dict[str, Any] = {}
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or field.types[:2] == [GGUFValueType.ARRAY, GGUFValueType.ARRAY]:
            continue
        try:
            metadata[name] = _field_value(field)
        except UnicodeDecodeError as exc:
            raise ModelLoadError(f"GGUF metadata {name} is not valid UTF-8: {exc}") from exc
    return metadata


def _uniform(value: Any, key: str) -> int:
    """Per-layer values (a list) are accepted only when every layer agrees."""
    if isinstance(value, list):
        if len(set(value)) != 1:
            raise ModelLoadError(f"{key} varies per layer ({sorted(set(value))}), which is not supported")
        return int(value[0])
    return int(value)


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


# Not decoder weights: the per-pair RoPE frequency divisors (RopeScaling.frequency_factors), and
# longrope's short and long ones (Phi-3).
ROPE_FREQS = "rope_freqs.weight"
LONGROPE_FACTORS = ("rope_factors_short.weight", "rope_factors_long.weight")
ROPE_TENSORS = (ROPE_FREQS, *LONGROPE_FACTORS)


def _frequency_factors(tensor: ReaderTensor, pairs: int) -> tuple[float, ...]:
    factors = dequantize_tensor(tensor).reshape(-1)
    if factors.shape[0] != pairs or not np.all(np.isfinite(factors) & (factors > 0)):
        raise ModelLoadError(f"{tensor.name} must hold {pairs} positive factors, has {factors.shape[0]}")
    return tuple(float(f) for f in factors)


def _rope_scaling(meta: dict[str, Any], arch: str, tensors: dict[str, ReaderTensor], rotary_dim: int) -> RopeScaling:
    kind = meta.get(f"{arch}.rope.scaling.type", "none")
    factor = meta.get(f"{arch}.rope.scaling.factor", meta.get(f"{arch}.rope.scale_linear"))
    if all(name in tensors for name in LONGROPE_FACTORS):
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is None:
            raise ModelLoadError(f"longrope factors without {arch}.rope.scaling.original_context_length")
        attention = meta.get(f"{arch}.rope.scaling.attn_factor")
        short, long = (_frequency_factors(tensors[name], rotary_dim // 2) for name in LONGROPE_FACTORS)
        return RopeScaling(
            rope_type="longrope",
            original_max_position_embeddings=int(original),
            short_factor=short,
            long_factor=long,
            attention_factor=_f32(attention) if attention is not None else None,
        )
    if ROPE_FREQS in tensors:
        if kind != "none" or factor is not None:
            raise ModelLoadError(f"{ROPE_FREQS} together with rope scaling type {kind!r} is not supported")
        factors = _frequency_factors(tensors[ROPE_FREQS], rotary_dim // 2)
        return RopeScaling(rope_type="frequency_factors", frequency_factors=factors)
    if kind == "none" and factor is None:
        return RopeScaling()
    if kind in ("none", "linear") and factor is not None:
        return RopeScaling(rope_type="linear", factor=_f32(factor))
    if kind == "yarn" and factor is not None:
        original = meta.get(f"{arch}.rope.scaling.original_context_length")
        if original is None:
            raise ModelLoadError(f"yarn rope scaling without {arch}.rope.scaling.original_context_length")
        attention = meta.get(f"{arch}.rope.scaling.attn_factor")
        return RopeScaling(
            rope_type="yarn",
            factor=_f32(factor),
            original_max_position_embeddings=int(original),
            beta_fast=_f32(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            beta_slow=_f32(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)),
            attention_factor=_f32(attention) if attention is not None else None,
        )
    raise ModelLoadError(f"rope scaling type {kind!r} in a GGUF file is not supported")


def gguf_config(reader: GGUFReader, metadata: dict[str, Any] | None = None) -> LlamaConfig:
    """The architecture described by the file's `{arch}.*` and `tokenizer.ggml.*` keys and its tensor list."""
    meta = gguf_metadata(reader) if metadata is None else metadata
    arch = meta.get("general.architecture")
    family = family_of_gguf_architecture(arch, f"GGUF {reader.data.filename}")

    def need(key: str) -> Any:
        if f"{arch}.{key}" not in meta:
            raise ModelLoadError(f"GGUF file lacks metadata key {arch}.{key}")
        return meta[f"{arch}.{key}"]

    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ModelLoadError("GGUF file has no token_embd.weight tensor")
    hidden = int(need("embedding_length"))
    heads = _uniform(need("attention.head_count"), f"{arch}.attention.head_count")
    kv_heads = _uniform(meta.get(f"{arch}.attention.head_count_kv", heads), f"{arch}.attention.head_count_kv")
    head_dim = int(meta.get(f"{arch}.attention.key_length", hidden // heads))
    rotary_dim = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    layers = int(need("block_count"))
    # The keys of config.json a family's window and RoPE rules read, as the file states them.
    hf_like = {"num_hidden_layers": layers, "sliding_window": meta.get(f"{arch}.attention.sliding_window")}
    eos_ids = [
        meta[key]
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id")
        if key in meta
    ]
    fields: dict[str, Any] = dict(
        vocab_size=int(tensors["token_embd.weight"].shape[1]),
        hidden_size=hidden,
        intermediate_size=_uniform(need("feed_forward_length"), f"{arch}.feed_forward_length"),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=int(meta.get(f"{arch}.context_length", 2048)),
        rms_norm_eps=_f32(meta.get(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=_f32(meta.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=_rope_scaling(meta, arch, tensors, rotary_dim),
        rotary_dim=rotary_dim if rotary_dim != head_dim else 0,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm=family.qk_norm,
        norms_before=family.norms_before,
        norms_after=family.norms_after,
        attention_windows=family.windows(hf_like),
        rotary_layers=family.rotary(hf_like),
        embedding_multiplier=_f32(meta.get(f"{arch}.embedding_scale", 1.0)),
        residual_multiplier=_f32(meta.get(f"{arch}.residual_scale", 1.0)),
        attention_multiplier=_f32(meta[f"{arch}.attention.scale"]) if f"{arch}.attention.scale" in meta else None,
        logits_scaling=_f32(meta.get(f"{arch}.logit_scale", 1.0)),
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=tuple(dict.fromkeys(int(i) for i in eos_ids)),
        architecture=family.name,
    )
    experts = int(meta.get(f"{arch}.expert_count", 0))
    if experts:
        dense = int(meta.get(f"{arch}.leading_dense_block_count", 0))
        fields.update(
            num_experts=experts,
            experts_per_token=int(need("expert_used_count")),
            expert_intermediate_size=int(meta.get(f"{arch}.expert_feed_forward_length", fields["intermediate_size"])),
            # llama.cpp renormalises the chosen experts' weights of llama and qwen3moe files unless told.
            normalize_expert_weights=bool(meta.get(f"{arch}.expert_weights_norm", True)),
            sparse_layers=tuple(i >= dense for i in range(layers)) if dense else (),
        )
    try:
        return LlamaConfig(**{**fields, **family.gguf_settings(meta, arch, fields)})
    except ValueError as exc:
        raise ModelLoadError(f"inconsistent GGUF architecture metadata: {exc}") from exc


def hf_tensor_name(gguf_name: str, family: Family) -> str:
    """Maps a llama.cpp tensor name (`blk.3.attn_q.weight`) to its Hugging Face name in `family`."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    parts = gguf_name.split(".", 2)
    layer_names = {**_LAYER_NAMES, **family.gguf_layer_names}
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in layer_names:
        return f"model.layers.{parts[1]}.{layer_names[parts[2]]}"
    raise ModelLoadError(f"GGUF tensor {gguf_name!r} has no counterpart in the Llama-family decoder")


def dequantize_tensor(tensor: ReaderTensor) -> np.ndarray:
    """The tensor as a writable float32 array in torch dimension order (outermost first)."""
    try:
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    except NotImplementedError as exc:
        raise ModelLoadError(f"tensor {tensor.name}: ggml type {tensor.tensor_type.name} is not supported") from exc
    values = np.asarray(values, dtype=np.float32)
    if not values.flags.writeable or not values.flags.c_contiguous:
        values = np.array(values, dtype=np.float32, order="C")
    return values.reshape(tuple(int(d) for d in reversed(tensor.shape)))


def unpermute_rotary_rows(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Inverse of llama.cpp's `LlamaModel.permute`: per head, rows (r0, r_half, r1, r_half+1, ...) -> HF order."""
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ModelLoadError(f"cannot un-permute {rows} rows over {num_heads} heads")
    grouped = weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
    return grouped.transpose(1, 2).reshape(weight.shape).contiguous()


_KEPT_KINDS = {ggml_type: kind for kind, ggml_type in GGML_TYPES.items()}


def quantized_tensor(tensor: ReaderTensor, dtype: torch.dtype = torch.float32) -> QuantizedWeight | None:
    """A matrix whose ggml type the native kernels run against `dtype` activations, as its blocks (a
    copy); else None. BF16 weights run against bfloat16 activations only."""
    kind = _KEPT_KINDS.get(tensor.tensor_type)
    if kind is None or len(tensor.shape) not in (2, 3) or (kind == "bf16" and dtype != torch.bfloat16):
        return None
    rows = int(np.prod([int(d) for d in tensor.shape[1:]]))  # a 3-D tensor's experts one after another
    blocks = np.ascontiguousarray(tensor.data).view(np.uint8).reshape(rows, -1)
    return QuantizedWeight(torch.from_numpy(blocks.copy()), kind, int(tensor.shape[0]))


def tensor_rows(
    tensor: ReaderTensor, dtype: torch.dtype, keep_quantized: bool
) -> tuple[torch.Tensor, QuantizedWeight | None]:
    """A tensor's rows: its blocks, where kept quantized and the native kernels run its type against
    `dtype` activations, else float32 values; a matrix so widened gets a log line naming the tensor,
    its type and the bytes it then takes in `dtype`."""
    kept = quantized_tensor(tensor, dtype) if keep_quantized else None
    rows = kept.blocks if kept is not None else torch.from_numpy(dequantize_tensor(tensor))
    if len(tensor.shape) == 3:  # experts' rows one after another
        rows = rows.reshape(-1, rows.shape[-1])
    widened = len(tensor.shape) >= 2 and rows.numel() * dtype.itemsize > tensor.n_bytes
    if keep_quantized and kept is None and widened:
        log.warning(
            "GGUF tensor %s: ggml type %s has no native kernel against %s activations; widened: %s bytes instead of %s",
            tensor.name,
            tensor.tensor_type.name,
            dtype,
            f"{rows.numel() * dtype.itemsize:,}",
            f"{int(tensor.n_bytes):,}",
        )
    return rows, kept


def split_experts(name: str, rows: torch.Tensor, config: LlamaConfig) -> dict[str, torch.Tensor]:
    """A stacked expert tensor (`...mlp.experts.gate_proj.weight`, every expert's rows in turn) as
    one matrix per expert (`...mlp.experts.{e}.gate_proj.weight`); a stacked bias as one vector each."""
    if not config.num_experts or rows.shape[0] % config.num_experts:
        raise ValueError(f"{name} has {rows.shape[0]} rows, not a multiple of the {config.num_experts} experts")
    prefix, projection = name.split(_STACKED_EXPERTS)
    each = rows.shape[0] // config.num_experts
    pieces = {
        f"{prefix}{_STACKED_EXPERTS}{e}.{projection}": rows[e * each : (e + 1) * each]
        for e in range(config.num_experts)
    }
    if projection.endswith(".bias"):  # one row an expert: its bias
        return {piece: part.reshape(-1) for piece, part in pieces.items()}
    return pieces


def gguf_state_dict(
    reader: GGUFReader, config: LlamaConfig, dtype: torch.dtype = torch.float32, keep_quantized: bool = False
) -> dict[str, torch.Tensor | QuantizedWeight]:
    """Every tensor of the file, renamed, dequantized (unless kept quantized), un-permuted and cast;
    validated against `config`."""
    family = family_named(config.architecture)
    permuted = family.gguf_rows_permuted
    weights: dict[str, torch.Tensor | QuantizedWeight] = {}
    for tensor in reader.tensors:
        if tensor.name in ROPE_TENSORS:  # read into the config
            continue
        name = hf_tensor_name(tensor.name, family)
        rows, kept = tensor_rows(tensor, dtype, keep_quantized)
        if permuted and ".self_attn.q_proj." in name:
            rows = unpermute_rotary_rows(rows, config.num_heads)
        elif permuted and ".self_attn.k_proj." in name:
            rows = unpermute_rotary_rows(rows, config.num_kv_heads)
        try:  # a fused matrix split by rows: blocks too, each row's blocks being its own
            stacked = _STACKED_EXPERTS in name
            pieces = split_experts(name, rows, config) if stacked else family.unfuse(name, rows, config)
        except ValueError as exc:
            raise ModelLoadError(f"GGUF {reader.data.filename}: tensor {tensor.name}: {exc}") from exc
        for piece, part in pieces.items():
            weights[piece] = QuantizedWeight(part, kept.kind, kept.columns) if kept is not None else part.to(dtype)
    check_state_dict(config, weights, source=f"GGUF {reader.data.filename}")
    return weights


def load_gguf(path: str | Path, dtype: torch.dtype = torch.float32) -> tuple[LlamaConfig, dict[str, torch.Tensor]]:
    """Config and HF-named state dict of a GGUF file."""
    reader = open_gguf(path)
    config = gguf_config(reader)
    return config, gguf_state_dict(reader, config, dtype)
