"""What a model is before it is loaded: its family, parameters, tensor types and bytes, and KV bytes
per token, read from a GGUF file's header or a Hugging Face directory's config.json and safetensors
headers (no weight is read)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from safetensors import safe_open

from shoal.model.config import LlamaConfig
from shoal.model.errors import ModelLoadError
from shoal.model.gguf_loader import gguf_config, open_gguf
from shoal.model.hf_loader import hf_weight_files, load_hf_config
from shoal.model.llama import kv_bytes_per_token_per_layer
from shoal.model.registry import resolve_model

# Bytes per element of the safetensors dtypes a checkpoint stores its weights in.
_SAFETENSORS_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1}


@dataclass(frozen=True)
class ModelReport:
    """Invariant: `config` is set iff shoal can run the model; else `refusal` says why."""

    source: str
    format: str  # "gguf" or "hf"
    parameters: int
    weight_bytes: int
    tensor_types: dict[str, int] = field(default_factory=dict)  # type name -> tensors of it
    config: LlamaConfig | None = None
    refusal: str | None = None

    def kv_bytes_per_token(self, bytes_per_value: int = 2) -> int:
        """KV-cache bytes a token takes over all layers (16-bit cache by default)."""
        assert self.config is not None
        return self.config.num_layers * kv_bytes_per_token_per_layer(self.config, bytes_per_value)

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


def inspect_model(name_or_path: str) -> ModelReport:
    """The report of a built-in model name, a .gguf file or a Hugging Face directory. Raises
    ModelLoadError only when there is no model there; one shoal cannot run is a report that says so."""
    source = resolve_model(name_or_path)
    if source.kind == "gguf":
        reader = open_gguf(source.path)
        tensors = list(reader.tensors)
        report = ModelReport(
            source=name_or_path,
            format="gguf",
            parameters=sum(int(t.n_elements) for t in tensors),
            weight_bytes=sum(int(t.n_bytes) for t in tensors),
            tensor_types=dict(Counter(t.tensor_type.name for t in tensors)),
        )
        read_config = lambda: gguf_config(reader)  # noqa: E731
    else:
        types: Counter[str] = Counter()
        parameters = weight_bytes = 0
        for path in hf_weight_files(source.path):
            with safe_open(str(path), framework="pt") as shard:
                for name in shard.keys():
                    piece = shard.get_slice(name)
                    elements = 1
                    for size in piece.get_shape():
                        elements *= size
                    types[piece.get_dtype()] += 1
                    parameters += elements
                    weight_bytes += elements * _SAFETENSORS_BYTES.get(piece.get_dtype(), 4)
        report = ModelReport(name_or_path, "hf", parameters, weight_bytes, dict(types))
        read_config = lambda: load_hf_config(source.path)  # noqa: E731
    try:
        return ModelReport(**{**report.__dict__, "config": read_config()})
    except ModelLoadError as exc:
        return ModelReport(**{**report.__dict__, "refusal": str(exc)})
