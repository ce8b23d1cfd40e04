"""Engine configuration: one frozen dataclass, built by the CLI or tests and passed down."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs. Values found at run time (dtype chosen by "auto", cache size) are
    reported by the engine, never written back here.

    kv_cache_bytes, when set, is the KV budget; otherwise kv_cache_fraction of the free memory of
    the device is used. itl_target_ms turns on the adaptive batch size. prepack_weights trades the
    page sharing of memory-mapped weights for faster CPU matrix multiplies. attention_kernel picks
    the C++ CPU kernel ("rows") or the torch kernel ("tiles"); "auto" prefers rows on CPUs.
    step_delay_ms adds that much time to every step, to emulate slower hardware (tests, benchmarks).
    tensor_parallel_size > 1 shards every layer over that many processes on this host (one failure
    domain); pipeline_parallel_size > 1 splits the layers into that many stage processes linked by
    messages (layers_per_stage overrides the planned split); pipeline_wire_dtype is the dtype of the
    activations between stages ("auto": the model's, lossless; "bfloat16" halves float32 traffic).
    """

    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float = 0.1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    batch_invariant: bool = True
    prepack_weights: bool = True
    attention_kernel: str = "auto"
    itl_target_ms: float | None = None
    seed: int = 0
    num_threads: int | None = None
    cache_dir: str | None = None
    step_delay_ms: float = 0.0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    layers_per_stage: tuple[int, ...] | None = None
    pipeline_wire_dtype: str = "auto"
    pipeline_stage_addresses: tuple[str, ...] = ()
    pipeline_spare_addresses: tuple[str, ...] = ()
    pipeline_spares: int = 0

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size",
                     "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.pipeline_wire_dtype != "auto" and self.pipeline_wire_dtype not in DTYPES:
            raise ValueError(f"pipeline_wire_dtype must be auto or one of {sorted(DTYPES)}")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError("kv_cache_fraction must be in (0, 1]")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "EngineConfig":
        """Builds a config (from JSON too: lists become the tuples the fields hold); unknown keys are errors."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown engine config keys: {unknown}")
        return cls(**{key: tuple(value) if isinstance(value, list) else value for key, value in raw.items()})

    def resolve_device(self, rank: int = 0) -> torch.device:
        """The device of tensor-parallel rank `rank`: on CUDA, the rank-th GPU from the one named."""
        if self.device == "auto":
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            device = torch.device(self.device)
        if device.type == "cuda":
            return torch.device("cuda", (device.index or 0) + rank)
        return device

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        """auto: bfloat16 where the hardware computes it natively (CUDA, CPUs with AVX512-BF16/AMX)."""
        if self.dtype != "auto":
            return DTYPES[self.dtype]
        if device.type == "cuda" or _cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32


def _cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags
