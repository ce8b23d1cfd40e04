"""On-disk cache of converted weights: one safetensors file per (source files' identity, dtype, and
whether GGUF-quantized matrices are kept quantized).

Invariants:
- An entry's name is derived from the resolved path, size and mtime_ns of every source file, the dtype
  and CACHE_FORMAT; a changed source or converter version gives a different entry, never a stale one.
- Entries are written to a temporary file and renamed into place, so readers see whole files only.
- Loaded tensors are views of one private (copy-on-write) memory mapping of the entry: nothing is read
  or copied up front, and processes on one host share the page-cache pages until one writes to them.
- A quantized entry stores each QuantizedWeight's blocks as a uint8 tensor, and its kind and column
  count in the metadata key `shoal.quantized`; every other tensor is in the entry's dtype.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from shoal.model.config import LlamaConfig, RopeScaling
from shoal.model.quantized_weight import QuantizedWeight

CACHE_FORMAT = "5"
CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_SAFETENSORS_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "U8": torch.uint8}
_RESERVED_KEYS = ("shoal.format", "shoal.config", "shoal.sources", "shoal.dtype", "shoal.quantized")
Weights = Mapping[str, torch.Tensor | QuantizedWeight]


def default_cache_dir() -> Path:
    """`$SHOAL_CACHE_DIR`, else `~/.cache/shoal`."""
    return Path(os.environ.get("SHOAL_CACHE_DIR") or Path.home() / ".cache" / "shoal")


def config_to_json(config: LlamaConfig) -> str:
    return json.dumps(dataclasses.asdict(config), sort_keys=True)


def config_from_json(text: str) -> LlamaConfig:
    """Inverse of `config_to_json`."""
    raw = json_tuples(json.loads(text))
    raw["rope_scaling"] = RopeScaling(**raw["rope_scaling"])
    return LlamaConfig(**raw)


def json_tuples(fields: dict) -> dict:
    """A dataclass's fields read back from JSON: its lists (which were tuples) as tuples again, in
    nested dicts too."""
    return {
        key: tuple(value) if isinstance(value, list) else json_tuples(value) if isinstance(value, dict) else value
        for key, value in fields.items()
    }


def source_identity(sources: Sequence[str | Path]) -> str:
    """JSON naming each source file by resolved path, size and mtime_ns (in the given order)."""
    entries = []
    for source in sources:
        path = Path(source).resolve()
        stat = path.stat()
        entries.append([str(path), stat.st_size, stat.st_mtime_ns])
    return json.dumps(entries)


def _dtype_name(dtype: torch.dtype) -> str:
    if dtype not in CACHE_DTYPES:
        raise ValueError(f"unsupported cache dtype {dtype}; use one of {CACHE_DTYPES}")
    return str(dtype).removeprefix("torch.")


def _in_dtype(weight: torch.Tensor | QuantizedWeight, dtype: torch.dtype) -> bool:
    """Whether a weight belongs in an entry of `dtype`: quantized ones belong in every entry."""
    return isinstance(weight, QuantizedWeight) or weight.dtype == dtype


@dataclass(frozen=True)
class CacheEntry:
    """A loaded entry: memory-mapped weights, their config, and the caller's extra string metadata."""

    path: Path
    config: LlamaConfig
    weights: dict[str, torch.Tensor | QuantizedWeight]
    extra: dict[str, str]


def map_safetensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors of a safetensors file as views of one copy-on-write mapping of it, plus its metadata."""
    path = Path(path)
    with open(path, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    metadata = header.pop("__metadata__", None) or {}
    storage = torch.UntypedStorage.from_file(str(path), shared=False, nbytes=path.stat().st_size)
    data_start = 8 + header_len
    tensors = {}
    for name, info in header.items():
        dtype = _SAFETENSORS_DTYPES[info["dtype"]]
        itemsize = dtype.itemsize
        begin, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if (data_start + begin) % itemsize or end - begin != itemsize * torch.Size(shape).numel():
            raise ValueError(f"{path}: tensor {name} is misaligned or has a wrong byte length")
        tensor = torch.empty(0, dtype=dtype)
        tensor.set_(storage, (data_start + begin) // itemsize, shape)
        tensors[name] = tensor
    return tensors, metadata


class WeightCache:
    """A directory of converted checkpoints keyed by source identity and dtype."""

    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root is not None else default_cache_dir()

    def entry_path(self, sources: Sequence[str | Path], dtype: torch.dtype, quantized: bool = False) -> Path:
        """Where the entry for these sources and dtype lives (whether or not it exists)."""
        dtype_name = _dtype_name(dtype) + ("-quantized" if quantized else "")
        identity = source_identity(sources)
        digest = hashlib.sha256(f"{CACHE_FORMAT}\n{dtype_name}\n{identity}".encode()).hexdigest()[:24]
        return self.root / f"{Path(sources[0]).name}.{dtype_name}.{digest}.safetensors"

    def load(self, sources: Sequence[str | Path], dtype: torch.dtype, quantized: bool = False) -> CacheEntry | None:
        """The entry, memory-mapped; None when absent, unreadable or written for other sources/dtype."""
        path = self.entry_path(sources, dtype, quantized)
        if not path.is_file():
            return None
        try:
            weights, metadata = map_safetensors(path)
            valid = (
                metadata.get("shoal.format") == CACHE_FORMAT
                and metadata.get("shoal.dtype") == _dtype_name(dtype)
                and metadata.get("shoal.sources") == source_identity(sources)
            )
            config = config_from_json(metadata["shoal.config"]) if valid else None
            kinds = json.loads(metadata.get("shoal.quantized", "{}"))
            for name, (kind, columns) in kinds.items():
                weights[name] = QuantizedWeight(weights[name], kind, columns)
        except (OSError, ValueError, KeyError, TypeError, RuntimeError, struct.error):
            return None
        if config is None or (kinds and not quantized) or not all(_in_dtype(t, dtype) for t in weights.values()):
            return None
        extra = {k: v for k, v in metadata.items() if k not in _RESERVED_KEYS}
        return CacheEntry(path=path, config=config, weights=weights, extra=extra)

    def store(
        self,
        sources: Sequence[str | Path],
        dtype: torch.dtype,
        config: LlamaConfig,
        weights: Weights,
        extra: Mapping[str, str] | None = None,
        quantized: bool = False,
    ) -> Path:
        """Writes the entry atomically (temp file + rename) and returns its path. Weights must be `dtype`,
        or QuantizedWeight in a quantized entry."""
        wrong = [name for name, t in weights.items() if not _in_dtype(t, dtype)]
        if wrong:
            raise ValueError(f"tensors {wrong[:4]} are not {dtype}")
        extra = dict(extra or {})
        clash = set(extra) & set(_RESERVED_KEYS)
        if clash:
            raise ValueError(f"extra metadata keys {sorted(clash)} are reserved")
        kinds = {name: [w.kind, w.columns] for name, w in weights.items() if isinstance(w, QuantizedWeight)}
        if kinds and not quantized:
            raise ValueError(f"quantized weights {sorted(kinds)[:4]} need a quantized entry")
        path = self.entry_path(sources, dtype, quantized)
        metadata = {
            **extra,
            "shoal.format": CACHE_FORMAT,
            "shoal.dtype": _dtype_name(dtype),
            "shoal.sources": source_identity(sources),
            "shoal.config": config_to_json(config),
            **({"shoal.quantized": json.dumps(kinds)} if kinds else {}),
        }
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=self.root)
        os.close(fd)
        try:
            tensors = {
                name: (t.blocks if isinstance(t, QuantizedWeight) else t).contiguous() for name, t in weights.items()
            }
            save_file(tensors, tmp_name, metadata=metadata)
            with open(tmp_name, "rb+") as f:
                os.fsync(f.fileno())
            os.chmod(tmp_name, 0o644)
            os.replace(tmp_name, path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        return path
