"""LoRA adapters from PEFT directories (`adapter_config.json` and `adapter_model.safetensors`), checked
against the base model before any is used.

An adapter adds, to a projection's output for an input row x, scaling * B (A x), with A [rank, in]
and B [out, rank] per layer and projection (q/k/v/o of attention, gate/up/down of the MLP).
`scaling` is lora_alpha / rank, or lora_alpha / sqrt(rank) with rsLoRA. What PEFT can write that
this engine does not apply (DoRA, trained biases, extra saved modules, per-module rank patterns)
is refused by name rather than dropped.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load

from shoal.model.config import LlamaConfig
from shoal.model.errors import ModelLoadError
from shoal.model.families import family_named

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")
# PEFT settings this engine applies only at their plain value.
_EMPTY = torch.empty(0, 0)
_PLAIN = {"use_dora": False, "bias": "none", "fan_in_fan_out": False, "modules_to_save": None}


class LoraAdapterError(ModelLoadError):
    """An adapter that cannot be used with this base model; the message names the file and why."""


@dataclass(frozen=True)
class LoraPair:
    """One projection's adapter: A [rank, in] and B [out, rank], float32, B already times scaling."""

    a: torch.Tensor
    b: torch.Tensor


@dataclass(frozen=True)
class LoraAdapter:
    """Invariant: every pair's shapes match the base model's projection and rank <= the maximum it
    was loaded under; `digest` is the SHA-256 of the weights file (what tells two adapters apart
    in the prefix cache)."""

    name: str
    path: str
    rank: int
    scaling: float
    digest: str
    pairs: dict[tuple[int, str], LoraPair]

    @property
    def nbytes(self) -> int:
        return sum(p.a.numel() * p.a.element_size() + p.b.numel() * p.b.element_size() for p in self.pairs.values())


def adapter_memory_bytes(config: LlamaConfig, rank: int) -> int:
    """The most one held adapter of `rank` takes: every projection of every layer adapted, its A and
    B in float32 and a second copy of each (B transposed for the CPU kernel, or the packed pair)."""
    per_layer = sum(sum(projection_shape(config, target)) for target in LORA_TARGETS)
    return 2 * config.num_layers * per_layer * rank * 4


def projection_shape(config: LlamaConfig, target: str) -> tuple[int, int]:
    """(out, in) of a projection of the base model."""
    attention = config.num_heads * config.head_dim
    kv = config.num_kv_heads * config.head_dim
    return {
        "q_proj": (attention, config.hidden_size),
        "k_proj": (kv, config.hidden_size),
        "v_proj": (kv, config.hidden_size),
        "o_proj": (config.hidden_size, attention),
        "gate_proj": (config.intermediate_size, config.hidden_size),
        "up_proj": (config.intermediate_size, config.hidden_size),
        "down_proj": (config.hidden_size, config.intermediate_size),
    }[target]


@dataclass(frozen=True)
class AdapterFiles:
    """An adapter's files as read from disk, before torch sees them (so any thread may read them):
    its settings, its weights file's bytes and their SHA-256 (checked where one was given)."""

    root: Path
    settings: dict
    weights_path: Path
    data: bytes
    digest: str


def read_peft_files(directory: str | Path, sha256: str | None = None) -> AdapterFiles:
    """A PEFT directory's settings and weights; LoraAdapterError naming the file and the reason when
    one is missing or not JSON, the settings use a PEFT feature not applied here, or the weights are
    not the given `sha256`."""
    root = Path(directory)
    settings = _settings(root / CONFIG_FILE)
    weights_path = root / WEIGHTS_FILE
    try:
        data = weights_path.read_bytes()
    except OSError as exc:
        raise LoraAdapterError(f"{weights_path}: cannot be read ({exc.strerror})") from None
    digest = hashlib.sha256(data).hexdigest()
    if sha256 is not None and digest != sha256.lower():
        raise LoraAdapterError(f"{weights_path}: SHA-256 is {digest}, not the {sha256} given")
    return AdapterFiles(root, settings, weights_path, data, digest)


def peft_adapter(name: str, files: AdapterFiles, base: LlamaConfig, max_rank: int) -> LoraAdapter:
    """The adapter `files` hold, for `base`; LoraAdapterError naming the file and the reason when its
    rank is above `max_rank`, its weights are corrupt or for other shapes."""
    settings, config_path = files.settings, files.root / CONFIG_FILE
    rank, alpha = settings.get("r"), settings.get("lora_alpha", settings.get("r"))
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise LoraAdapterError(f"{config_path}: r must be a positive integer and lora_alpha a number")
    if rank > max_rank:
        raise LoraAdapterError(f"{config_path}: rank {rank} is above this engine's max_lora_rank {max_rank}")
    try:
        tensors = load(files.data)
    except (SafetensorError, ValueError) as exc:
        raise LoraAdapterError(f"{files.weights_path}: not a safetensors file ({exc})") from None
    scaling = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    halves = unfused_halves(files.weights_path, _peft_halves(files.weights_path, tensors), base)
    pairs = checked_pairs(files.weights_path, halves, base, rank, scaling)
    return LoraAdapter(name, str(files.root), rank, scaling, files.digest, pairs)


def load_peft_adapter(
    name: str, directory: str | Path, base: LlamaConfig, max_rank: int, sha256: str | None = None
) -> LoraAdapter:
    """The adapter in a PEFT directory, for `base` (read_peft_files, then peft_adapter)."""
    return peft_adapter(name, read_peft_files(directory, sha256), base, max_rank)


def _settings(path: Path) -> dict:
    try:
        settings = json.loads(path.read_text())
    except OSError as exc:
        raise LoraAdapterError(f"{path}: cannot be read ({exc.strerror})") from None
    except json.JSONDecodeError as exc:
        raise LoraAdapterError(f"{path}: not JSON ({exc})") from None
    if not isinstance(settings, dict) or settings.get("peft_type", "LORA") != "LORA":
        raise LoraAdapterError(f"{path}: not a LoRA adapter (peft_type {settings.get('peft_type')!r})")
    for key, plain in _PLAIN.items():
        if settings.get(key, plain) not in (plain, [], {}):
            raise LoraAdapterError(f"{path}: {key}={settings[key]!r} is not supported (only {plain!r})")
    for key in ("rank_pattern", "alpha_pattern"):
        if settings.get(key):
            raise LoraAdapterError(f"{path}: {key} (ranks or alphas per module) is not supported")
    return settings


def _peft_halves(path: Path, tensors: dict[str, torch.Tensor]) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """A PEFT file's tensors as each projection's halves, by (layer, projection), "A" and "B"."""
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.match(key)
        if match is None:
            raise LoraAdapterError(f"{path}: {key} is not a LoRA weight of a q/k/v/o/gate/up/down projection")
        halves.setdefault((int(match.group(1)), match.group(2)), {})[match.group(3)] = tensor
    return halves


def unfused_halves(
    path: Path, halves: dict[tuple[int, str], dict[str, torch.Tensor]], base: LlamaConfig
) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    """A fused projection's halves (Phi-3's qkv_proj and gate_up_proj) as its parts' halves, split as
    the family splits the fused weight: each part's rows of B, and the A they share."""
    family = family_named(base.architecture)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for (layer, target), found in halves.items():
        block = "self_attn" if target.startswith(("q", "k", "v", "o")) else "mlp"
        try:
            pieces = family.unfuse(f"model.layers.{layer}.{block}.{target}.weight", found.get("B", _EMPTY), base)
        except ValueError as exc:
            raise LoraAdapterError(f"{path}: lora_B of {exc}") from None
        if target in LORA_TARGETS or len(pieces) == 1:
            parts[(layer, target)] = found
            continue
        for name, b in pieces.items():
            parts[(layer, name.rsplit(".", 2)[-2])] = {**found, "B": b}
    return parts


def checked_pairs(
    path: Path, halves: dict[tuple[int, str], dict[str, torch.Tensor]], base: LlamaConfig, rank: int, scaling: float
) -> dict[tuple[int, str], LoraPair]:
    """Each projection's pair, float32, B times `scaling`; LoraAdapterError naming the file and the
    projection where one is not a q/k/v/o/gate/up/down projection of a layer of `base`, lacks a half,
    or is not of `rank` and the projection's shape."""
    if not halves:
        raise LoraAdapterError(f"{path}: holds no LoRA weights")
    pairs = {}
    for (layer, target), found in sorted(halves.items()):
        if target not in LORA_TARGETS:
            raise LoraAdapterError(f"{path}: layer {layer} {target} is not a q/k/v/o/gate/up/down projection")
        if layer >= base.num_layers:
            raise LoraAdapterError(f"{path}: layer {layer} {target}: the base model has {base.num_layers} layers")
        if set(found) != {"A", "B"}:
            raise LoraAdapterError(f"{path}: layer {layer} {target} has lora_{''.join(found)} without its other half")
        out, into = projection_shape(base, target)
        a, b = found["A"], found["B"]
        if tuple(a.shape) != (rank, into) or tuple(b.shape) != (out, rank):
            raise LoraAdapterError(
                f"{path}: layer {layer} {target} has A {tuple(a.shape)} and B {tuple(b.shape)}; this base "
                f"model needs A ({rank}, {into}) and B ({out}, {rank})"
            )
        pairs[(layer, target)] = LoraPair(a.float().contiguous(), (b.float() * scaling).contiguous())
    return pairs
