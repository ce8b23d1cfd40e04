"""LoRA adapters in llama.cpp's GGUF format, as its convert_lora_to_gguf.py writes them: general.type
"adapter", adapter.type "lora", adapter.lora.alpha, and for each adapted projection
`blk.N.<tensor>.weight.lora_a` [rank, in] and `.lora_b` [out, rank] in any ggml type, the rows of q
and k in the converter's rotary order (as the base model's weights are). Scaled as llama.cpp scales
them: alpha / rank, or 1 where alpha is 0 (the file does not record rsLoRA).

Reading (`read_gguf_lora`) uses numpy only, so it may run on any thread; `gguf_adapter` makes the
adapter for a base model on the engine's thread."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shoal.model.config import LlamaConfig
from shoal.model.errors import ModelLoadError
from shoal.model.families import family_named, family_of_gguf_architecture
from shoal.model.gguf_loader import dequantize_tensor, gguf_metadata, hf_tensor_name, open_gguf, unpermute_rotary_rows
from shoal.model.lora_adapter import LoraAdapter, LoraAdapterError, checked_pairs, unfused_halves

_HF_KEY = re.compile(r"^model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.weight$")
_HALVES = {".lora_a": "A", ".lora_b": "B"}


@dataclass(frozen=True)
class GgufLoraFiles:
    """A LoRA GGUF as read: its ggml architecture, alpha, and each adapted projection's halves
    (float32 arrays by (layer, Hugging Face projection name), "A" and "B"), q/k rows as written."""

    root: Path
    digest: str
    architecture: str
    alpha: float
    halves: dict[tuple[int, str], dict[str, np.ndarray]]


def read_gguf_lora(path: str | Path, sha256: str | None = None) -> GgufLoraFiles:
    """The adapter in a LoRA GGUF; LoraAdapterError naming the file and the reason when it cannot be
    read, is not the given `sha256`, is another kind of GGUF, or holds a tensor that is not a half of
    a q/k/v/o/gate/up/down projection's LoRA."""
    path = Path(path)
    try:
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError as exc:
        raise LoraAdapterError(f"{path}: cannot be read ({exc.strerror})") from None
    if sha256 is not None and digest != sha256.lower():
        raise LoraAdapterError(f"{path}: SHA-256 is {digest}, not the {sha256} given")
    try:
        reader = open_gguf(path)
        metadata = gguf_metadata(reader)
        if metadata.get("general.type") != "adapter" or metadata.get("adapter.type") != "lora":
            kind = metadata.get("adapter.type") or metadata.get("general.type") or "model"
            raise LoraAdapterError(f"{path}: a GGUF {kind}, not a LoRA adapter")
        architecture = metadata.get("general.architecture")
        family = family_of_gguf_architecture(architecture, str(path))
        halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
        for tensor in reader.tensors:
            suffix = tensor.name[-7:]
            match = _HF_KEY.match(hf_tensor_name(tensor.name[:-7], family)) if suffix in _HALVES else None
            if match is None:
                raise LoraAdapterError(f"{path}: {tensor.name} is not a LoRA half of a q/k/v/o/gate/up/down projection")
            halves.setdefault((int(match.group(1)), match.group(2)), {})[_HALVES[suffix]] = dequantize_tensor(tensor)
    except LoraAdapterError:
        raise
    except ModelLoadError as exc:
        raise LoraAdapterError(f"{path}: {exc}") from None
    return GgufLoraFiles(path, digest, architecture, float(metadata.get("adapter.lora.alpha", 0.0)), halves)


def gguf_adapter(name: str, files: GgufLoraFiles, base: LlamaConfig, max_rank: int) -> LoraAdapter:
    """The adapter `files` hold, for `base`; LoraAdapterError naming the file and the reason when it
    is for another architecture, its ranks differ or exceed `max_rank`, or its shapes are another
    model's."""
    family = family_named(base.architecture)
    if files.architecture not in family.gguf_architectures:
        raise LoraAdapterError(
            f"{files.root}: a LoRA for {files.architecture} models; this model is {base.architecture}"
        )
    ranks = {half.shape[0] for found in files.halves.values() for key, half in found.items() if key == "A"}
    if len(ranks) > 1:
        raise LoraAdapterError(f"{files.root}: its projections have ranks {sorted(ranks)}; one rank is applied")
    rank = ranks.pop() if ranks else 0
    if rank > max_rank:
        raise LoraAdapterError(f"{files.root}: rank {rank} is above this engine's max_lora_rank {max_rank}")
    rows_per_head = {"q_proj": base.num_heads, "k_proj": base.num_kv_heads}
    halves = {}
    for (layer, target), found in files.halves.items():
        tensors = {key: torch.from_numpy(array) for key, array in found.items()}
        if family.gguf_rows_permuted and target in rows_per_head and "B" in tensors:
            tensors["B"] = unpermute_rotary_rows(tensors["B"], rows_per_head[target])
        halves[(layer, target)] = tensors
    scaling = files.alpha / rank if files.alpha else 1.0
    pairs = checked_pairs(files.root, unfused_halves(files.root, halves, base), base, rank, scaling)
    return LoraAdapter(name, str(files.root), rank, scaling, files.digest, pairs)
