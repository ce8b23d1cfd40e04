"""What a model is before it is loaded: its family, parameters, tensor types and bytes, and KV bytes
per token, read from a GGUF file's header or a Hugging Face directory's config.json and safetensors
headers (no weight is read)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from safetensors import safe_open

from shoal.model.config import LlamaConfig
from shoal.model.errors import ModelLoadError
from shoal.model.gguf_header import read_gguf_header
from shoal.model.gguf_loader import gguf_config, open_gguf
from shoal.model.hf_loader import hf_weight_files, load_hf_config
from shoal.model.llama import kv_bytes_per_token_per_layer
from shoal.model.quantized_weight import GGML_TYPES
from shoal.model.registry import resolve_model

# Bytes per element of the safetensors dtypes a checkpoint stores its weights in.
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}


def _sizes(entries: Iterable[tuple[str, int, int]]) -> dict[str, tuple[int, int]]:
    """(type, elements, bytes) of each tensor, summed per type."""
    sizes: dict[str, tuple[int, int]] = {}
    for kind, elements, size in entries:
        total = sizes.get(kind, (0, 0))
        sizes[kind] = (total[0] + elements, total[1] + size)
    return sizes


@dataclass(frozen=True)
class ModelReport:
    """Invariant: `config` is set iff shoal can run the model, else `refusal` says why (neither in a
    report of the tensors alone)."""

    source: str
    format: str  # "gguf" or "hf"
    parameters: int
    weight_bytes: int
    tensor_types: dict[str, int] = field(default_factory=dict)  # type name -> tensors of it
    # type name -> (elements, bytes on disk) of the tensors of that type
    type_sizes: dict[str, tuple[int, int]] = field(default_factory=dict)
    config: LlamaConfig | None = None
    refusal: str | None = None

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """KV-cache bytes a token takes over all layers (16-bit cache by default)."""
        assert self.config is not None
        return self.config.num_layers * kv_bytes_per_token_per_layer(self.config, bytes_per_value)

    def weight_bytes_in_memory(self, bytes_per_value: int, keep_quantized: bool) -> int:
        """The least memory the loaded weights take: blocks of the natively run GGUF types as they are
        (with keep_quantized), every other tensor at `bytes_per_value` an element."""
        kept = {kind.name for kind in GGML_TYPES.values()} if keep_quantized and self.format == "gguf" else set()
        return sum(
            size if name in kept else elements * bytes_per_value for name, (elements, size) in self.type_sizes.items()
        )

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
        return [
            *lines,
            f"family: {config.architecture}; {config.num_layers} layers, hidden {config.hidden_size}, "
            f"{config.num_heads} heads ({config.num_kv_heads} KV) of {config.head_dim}, vocabulary {config.vocab_size}",
            f"KV cache per token: {self.kv_bytes_per_token(2):,} bytes in 16 bits, "
            f"{self.kv_bytes_per_token(4):,} in 32",
            "runs here: yes",
        ]


def inspect_model(name_or_path: str, with_config: bool = True) -> ModelReport:
    """The report of a built-in model name, a .gguf file or a Hugging Face directory. Raises
    ModelLoadError only when there is no model there; one shoal cannot run is a report that says so.
    Without `with_config`, the tensors alone (config and refusal unset): what a fit check needs."""
    source = resolve_model(name_or_path)
    if source.kind == "gguf":
        tensors = read_gguf_header(source.path).tensors
        report = ModelReport(
            source=name_or_path,
            format="gguf",
            parameters=sum(t.elements for t in tensors),
            weight_bytes=sum(t.bytes for t in tensors),
            tensor_types=dict(Counter(t.type_name for t in tensors)),
            type_sizes=_sizes(tensor[1:] for tensor in tensors),
        )
        read_config = lambda: gguf_config(open_gguf(source.path))  # noqa: E731
    else:
        entries = []
        for path in hf_weight_files(source.path):
            with safe_open(str(path), framework="pt") as shard:
                for name in shard.keys():
                    piece = shard.get_slice(name)
                    elements = math.prod(piece.get_shape())
                    entries.append(
                        (piece.get_dtype(), elements, elements * _SAFETENSORS_BYTES.get(piece.get_dtype(), 4))
                    )
        report = ModelReport(
            name_or_path,
            "hf",
            parameters=sum(elements for _, elements, _ in entries),
            weight_bytes=sum(size for _, _, size in entries),
            tensor_types=dict(Counter(kind for kind, _, _ in entries)),
            type_sizes=_sizes(entries),
        )
        read_config = lambda: load_hf_config(source.path)  # noqa: E731
    if not with_config:
        return report
    try:
        return ModelReport(**{**report.__dict__, "config": read_config()})
    except ModelLoadError as exc:
        return ModelReport(**{**report.__dict__, "refusal": str(exc)})
