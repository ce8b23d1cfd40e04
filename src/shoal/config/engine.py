"""Engine configuration: one frozen dataclass, built by the CLI, a deployment or tests and passed
down. It imports nothing heavy: what "auto" resolves to on this machine is runner.devices' work."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from shoal.config.speculative import SpeculativeConfig

DTYPE_NAMES = ("float32", "bfloat16", "float16")
POOLINGS = ("last", "mean")


@dataclass(frozen=True)
class EngineConfig:
    """How one engine runs. Values found at run time (dtype chosen by "auto", cache size) are
    reported by the engine, never written back here.

    kv_cache_bytes, when set, is the KV budget; otherwise kv_cache_fraction of the free memory of
    the device is used. itl_target_ms turns on the adaptive batch size. share_weights keeps the
    memory-mapped weights shared between the host's workers instead of repacking a private copy for
    faster CPU matrix multiplies. keep_quantized runs a GGUF file's Q8_0/Q4_0/Q4_1/Q4_K/Q6_K
    matrices as they are on CPUs (the native kernels, private packed weights); False dequantizes
    them to dtype. batch_invariant=False gives up
    batch invariance for torch's own kernels: one plain multiply per projection over the whole batch,
    on the weights where they lie (GGUF matrices dequantized), each layer as torch code; it exists
    to measure what invariance costs (benchmarks/batch_invariance_cost.py). attention_kernel picks
    the C++ CPU kernel ("rows") or the torch kernel ("tiles"); "auto" prefers rows on CPUs.
    step_delay_ms adds that much time to every step, to emulate slower hardware (tests, benchmarks).
    seed draws the sampling seed of each request that names none (None: from the OS, so replicas
    and restarts draw differently); every drawn seed is reported, so a stream resumes exactly.
    tensor_parallel_size > 1 shards every layer over that many processes on this host (one failure
    domain), a mixture's experts by their intermediate columns, or with enable_expert_parallel whole
    experts on each rank (shoal.model.sharding); pipeline_parallel_size > 1 splits the layers into
    that many stage processes linked by messages (layers_per_stage overrides the planned split);
    pipeline_wire_dtype is the dtype of the activations between stages ("auto": the model's,
    lossless; "bfloat16" halves float32 traffic); stage_servers are `shoal stage` addresses for the
    stages after the first, spare_stage_servers wait to replace a lost one, spare_stages local
    processes do the same. A micro-batch that takes longer than pipeline_step_deadline_s makes the
    head ping its stages; one that does not answer within pipeline_ping_timeout_s (a stage answers
    between steps, so this must exceed its longest step) is replaced. kv_tier_host_bytes and
    kv_tier_disk_bytes size the KV tier below the paged cache (shoal.engine.kv_tier; 0: none), its
    disk files under kv_tier_dir (default: the cache directory's kv-tier); kv_tier_shared also reads
    the other engines' files there. embedding_pooling ("last" token or "mean" of the prompt's) and
    embedding_normalize (to unit length) say how /v1/embeddings pools the final hidden states.
    background_step_tokens bounds the tokens background work (a router's batches) computes in one
    step, so an interactive request that arrives behind such a step waits only a short one.
    speculative says how decoding sequences draft tokens to verify in one step
    (shoal.config.speculative): it changes the speed, never the tokens. enable_lora lets requests
    run LoRA adapters (vLLM's names): lora_modules ("name=path" of PEFT directories) are loaded at
    start, more at run time; a step runs at most max_loras adapters, max_cpu_loras (default
    max_loras) stay in memory, least recently used given back first; ranks above max_lora_rank are
    refused; the adapters held count in the memory plan (the KV fraction is of what they leave
    free). lora_dir is where adapters may be loaded from at run time (a worker's
    /v1/load_lora_adapter; None: nowhere). kv_events publishes what the prefix cache and its tier
    gain and lose (shoal.engine.kv_event_log) for routers to follow, where the model's KV cache is
    one group (not for windowed or hybrid attention).

    Field names are the knob's one name in deployment YAML, CLI flags (--tensor-parallel-size) and
    Python, except the KV budget: YAML `kv_cache` and `--kv-cache` take a fraction or a size and
    set kv_cache_fraction or kv_cache_bytes (shoal.sizes.parse_kv_cache). The config travels to
    worker processes whole, as JSON (to_json / from_json).
    """

    model: str = "smollm2-135m-instruct"
    dtype: str = "auto"
    device: str = "auto"
    block_size: int = 16
    kv_cache_bytes: int | None = None
    kv_cache_fraction: float = 0.1
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    background_step_tokens: int = 32
    speculative: SpeculativeConfig = SpeculativeConfig()
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: tuple[str, ...] = ()
    lora_dir: str | None = None
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    kv_events: bool = True
    batch_invariant: bool = True
    share_weights: bool = False
    keep_quantized: bool = True
    attention_kernel: str = "auto"
    itl_target_ms: float | None = None
    seed: int | None = None
    num_threads: int | None = None
    cache_dir: str | None = None
    step_delay_ms: float = 0.0
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    pipeline_parallel_size: int = 1
    layers_per_stage: tuple[int, ...] | None = None
    pipeline_wire_dtype: str = "auto"
    stage_servers: tuple[str, ...] = ()
    spare_stage_servers: tuple[str, ...] = ()
    spare_stages: int = 0
    pipeline_step_deadline_s: float = 30.0
    pipeline_ping_timeout_s: float = 10.0
    kv_tier_host_bytes: int = 0
    kv_tier_disk_bytes: int = 0
    kv_tier_dir: str | None = None
    kv_tier_shared: bool = False
    embedding_pooling: str = "last"
    embedding_normalize: bool = True

    def __post_init__(self) -> None:
        if self.dtype != "auto" and self.dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be auto or one of {list(DTYPE_NAMES)}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu") and not self.device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {self.device!r}")
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "background_step_tokens",
            "tensor_parallel_size",
            "pipeline_parallel_size",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive")
        if self.pipeline_wire_dtype != "auto" and self.pipeline_wire_dtype not in DTYPE_NAMES:
            raise ValueError(f"pipeline_wire_dtype must be auto or one of {list(DTYPE_NAMES)}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ValueError("kv_cache_bytes must be positive")
        if self.spare_stages < 0:
            raise ValueError("spare_stages must not be negative")
        if self.pipeline_step_deadline_s <= 0 or self.pipeline_ping_timeout_s <= 0:
            raise ValueError("pipeline_step_deadline_s and pipeline_ping_timeout_s must be positive")
        if self.kv_tier_host_bytes < 0 or self.kv_tier_disk_bytes < 0:
            raise ValueError("kv_tier_host_bytes and kv_tier_disk_bytes must not be negative")
        if not 0.0 < self.kv_cache_fraction <= 1.0:
            raise ValueError("kv_cache_fraction must be in (0, 1]")
        if self.max_loras < 1 or self.max_lora_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be positive")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if self.lora_modules and not self.enable_lora:
            raise ValueError("lora_modules need enable_lora")
        self.lora_module_paths()
        if self.embedding_pooling not in POOLINGS:
            raise ValueError(f"embedding_pooling must be one of {', '.join(POOLINGS)}, got {self.embedding_pooling!r}")

    @property
    def held_loras(self) -> int:
        """How many LoRA adapters stay in memory at most."""
        return self.max_cpu_loras or self.max_loras

    def lora_module_paths(self) -> list[tuple[str, str]]:
        """lora_modules as (name, path); ValueError for an entry that is not name=path."""
        pairs = []
        for module in self.lora_modules:
            name, _, path = module.partition("=")
            if not name or not path:
                raise ValueError(f"a LoRA module is name=path, got {module!r}")
            pairs.append((name, path))
        return pairs

    @property
    def packs_weights(self) -> bool:
        """Whether the engine may pack a private copy of the weights for its CPU kernels."""
        return self.batch_invariant and not self.share_weights

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> EngineConfig:
        """Builds a config (from JSON too: lists become the tuples the fields hold, an object the
        speculative config); unknown keys are errors."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown engine config keys: {unknown}")
        values = {key: tuple(value) if isinstance(value, list) else value for key, value in raw.items()}
        if isinstance(values.get("speculative"), dict):
            values["speculative"] = SpeculativeConfig.from_dict(values["speculative"])
        return cls(**values)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> EngineConfig:
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("an engine config in JSON must be an object")
        return cls.from_dict(raw)
