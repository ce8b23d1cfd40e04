"""What a model is before it is loaded: its family, parameters, tensor types and bytes, and KV bytes
per token, read from a GGUF file's header or a Hugging Face directory's config.json and safetensors
headers (no weight is read)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from safetensors import safe_open

from shoal.model.config import LlamaConfig
from shoal.model.errors import ModelLoadError
from shoal.model.gguf_header import read_gguf_header
from shoal.model.gguf_loader import gguf_config, open_gguf
from shoal.model.hf_loader import hf_weight_files, load_hf_config
from shoal.model.llama import kv_bytes_per_token_per_layer
from shoal.model.quantized_weight import GGML_TYPES, PACKED_BYTES_PER_WEIGHT
from shoal.model.registry import resolve_model

# Bytes per element of the safetensors dtypes a checkpoint stores its weights in.
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}


class TypeTotals(NamedTuple):
    """The tensors of one type: how many, their elements and their bytes on disk."""

    tensors: int
    elements: int
    bytes: int


def _totals(entries: Iterable[tuple[str, int, int]]) -> dict[str, TypeTotals]:
    """(type, elements, bytes) of each tensor, summed per type."""
    totals: dict[str, TypeTotals] = {}
    for kind, elements, size in entries:
        count, total_elements, total_bytes = totals.get(kind, TypeTotals(0, 0, 0))
        totals[kind] = TypeTotals(count + 1, total_elements + elements, total_bytes + size)
    return totals


@dataclass(frozen=True)
class ModelReport:
    """Invariant: `config` is set iff shoal can run the model, else `refusal` says why (neither in a
    report of the tensors alone)."""

    source: str
    format: str  # "gguf" or "hf"
    types: dict[str, TypeTotals]  # per tensor type name
    config: LlamaConfig | None = None
    refusal: str | None = None

    @property
    def parameters(self) -> int:
        return sum(t.elements for t in self.types.values())

    @property
    def active_parameters(self) -> int:
        """The parameters a token runs through: all of them, less the experts a mixture's router
        leaves out of each sparse layer (their gate, up and down matrices; biases aside)."""
        config = self.config
        if config is None or not config.num_experts:
            return self.parameters
        sparse = sum(config.sparse(layer) for layer in range(config.num_layers))
        per_expert = 3 * config.hidden_size * config.expert_intermediate_size
        return self.parameters - sparse * (config.num_experts - config.experts_per_token) * per_expert

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights on disk."""
        return sum(t.bytes for t in self.types.values())

    @property
    def tensor_types(self) -> dict[str, int]:
        """Type name -> tensors of that type."""
        return {name: t.tensors for name, t in self.types.items()}

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """KV-cache bytes a token takes over the layers that keep every token (all but the
        sliding-window ones; 16-bit cache by default)."""
        config = self.config
        assert config is not None
        full = sum(not config.window(layer) for layer in range(config.num_layers))
        return full * kv_bytes_per_token_per_layer(config, bytes_per_value)

    def kv_window_bytes(self, bytes_per_value: int = 2) -> int:
        """The most KV-cache bytes a sequence's sliding-window layers hold (their window each)."""
        config = self.config
        assert config is not None
        windows = sum(config.window(layer) for layer in range(config.num_layers))
        return windows * kv_bytes_per_token_per_layer(config, bytes_per_value)

    def weight_bytes_in_memory(self, bytes_per_value: int, keep_quantized: bool) -> int:
        """The memory the loaded weights take: the natively run GGUF types (with keep_quantized) as
        the native kernel packs them, every other tensor at `bytes_per_value` an element."""
        packed = (
            {GGML_TYPES[kind].name: size for kind, size in PACKED_BYTES_PER_WEIGHT.items()}
            if keep_quantized and self.format == "gguf"
            else {}
        )
        return sum(int(t.elements * packed.get(name, bytes_per_value)) for name, t in self.types.items())

    def summary(self) -> dict[str, object]:
        """The report as one JSON-ready object."""
        config = self.config
        return {
            "model": self.source,
            "format": self.format,
            "parameters": self.parameters,
            "active_parameters": self.active_parameters,
            "weight_bytes": self.weight_bytes,
            "tensor_types": self.tensor_types,
            "family": config.architecture if config else None,
            "kv_bytes_per_token_16bit": self.kv_bytes_per_token(2) if config else None,
            "kv_window_bytes_16bit": self.kv_window_bytes(2) if config else None,
            "runs": config is not None,
            "refusal": self.refusal,
        }

    def lines(self) -> list[str]:
        """The report as text, a fact a line."""
        types = ", ".join(f"{name} x{count}" for name, count in sorted(self.tensor_types.items()))
        lines = [
            f"model: {self.source} ({self.format})",
            f"parameters: {self.parameters:,}",
            f"weights: {self.weight_bytes / 2**20:,.1f} MiB on disk; tensor types: {types}",
        ]
        if self.config is None:
            return [*lines, f"runs here: no: {self.refusal}"]
        config = self.config
        if config.num_experts:
            sparse = sum(config.sparse(layer) for layer in range(config.num_layers))
            lines.append(
                f"experts: {config.num_experts} of {config.expert_intermediate_size} in each of {sparse} sparse "
                f"layers, {config.experts_per_token} a token: {self.active_parameters:,} parameters a token"
            )
        return [
            *lines,
            f"family: {config.architecture}; {config.num_layers} layers, hidden {config.hidden_size}, "
            f"{config.num_heads} heads ({config.num_kv_heads} KV) of {config.head_dim}, vocabulary {config.vocab_size}",
            f"KV cache per token: {self.kv_bytes_per_token(2):,} bytes in 16 bits, "
            f"{self.kv_bytes_per_token(4):,} in 32{self._window_line()}",
            "runs here: yes",
        ]

    def _window_line(self) -> str:
        """What the sliding-window layers add: their window each, whatever the context (none: '')."""
        config = self.config
        windowed = sum(bool(config.window(layer)) for layer in range(config.num_layers))
        if not windowed:
            return ""
        return (
            f" in its {config.num_layers - windowed} full-attention layers; its {windowed} sliding-window layers "
            f"hold at most {config.sliding_window:,} tokens each ({self.kv_window_bytes(2):,} bytes in 16 bits "
            "a sequence)"
        )


def _safetensors_entries(model_dir: Path) -> list[tuple[str, int, int]]:
    """(dtype, elements, bytes) of every tensor of a Hugging Face directory, from the file headers."""
    entries = []
    for path in hf_weight_files(model_dir):
        with safe_open(str(path), framework="pt") as shard:
            for name in shard.keys():
                piece = shard.get_slice(name)
                elements = math.prod(piece.get_shape())
                entries.append((piece.get_dtype(), elements, elements * _SAFETENSORS_BYTES.get(piece.get_dtype(), 4)))
    return entries


def inspect_model(name_or_path: str, with_config: bool = True) -> ModelReport:
    """The report of a built-in model name, a .gguf file or a Hugging Face directory. Raises
    ModelLoadError only when there is no model there; one shoal cannot run is a report that says so.
    Without `with_config`, the tensors alone (config and refusal unset): what a fit check needs."""
    source = resolve_model(name_or_path)
    if source.kind == "gguf":
        entries = [(t.type_name, t.elements, t.bytes) for t in read_gguf_header(source.path).tensors]
    else:
        entries = _safetensors_entries(source.path)
    report = ModelReport(name_or_path, source.kind, _totals(entries))
    if not with_config:
        return report
    try:
        config = gguf_config(open_gguf(source.path)) if source.kind == "gguf" else load_hf_config(source.path)
    except ModelLoadError as exc:
        return dataclasses.replace(report, refusal=str(exc))
    return dataclasses.replace(report, config=config)
