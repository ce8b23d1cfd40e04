"""A whole deployment in one file: the models and their replicas, how each replica runs, the router's
settings (policy, fault tolerance, admission, state store) and how replicas are supervised.

One frozen pydantic model, validated up front; `describe` turns a validation failure into one line
per bad key ("models.0.replicas: ..."). The router's own settings are RouterConfig's, less what
the deployment decides itself (where it listens, its workers, the models' fallbacks).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import psutil
from pydantic import Field, ValidationError, field_validator, model_validator

from shoal.config.engine import EngineConfig
from shoal.protocol.worker_load import Role
from shoal.router.config import Frozen, ModelSettings, RouterConfig
from shoal.sizes import parse_kv_cache

DEFAULT_MODEL = "smollm2-135m-instruct"


class Resources(Frozen):
    """What one replica needs from a host."""

    cpus: float = Field(1.0, gt=0)
    gpus: float = Field(0.0, ge=0)
    custom: dict[str, float] = {}


class Autoscaling(Frozen):
    """Replicas between min and max, from the model's load against targets. Pressure (any signal
    over its target) for upscale_delay_s adds a replica; quiet (every signal under half its target)
    for downscale_delay_s removes one, drained first. With min_replicas 0 the model scales to zero
    when it gets no requests, and the first request waits (failover.wait_for_capacity_s) while a
    replica starts. A target left out (None) is not watched."""

    min_replicas: int = Field(1, ge=0)
    max_replicas: int = Field(4, ge=1)
    target_queued_per_replica: float | None = Field(2.0, gt=0)
    target_outstanding_tokens_per_replica: float | None = Field(None, gt=0)
    target_kv_cache_usage: float | None = Field(0.8, gt=0, le=1)
    target_ttft_s: float | None = Field(None, gt=0)
    target_itl_s: float | None = Field(None, gt=0)
    upscale_delay_s: float = Field(5.0, ge=0)
    downscale_delay_s: float = Field(60.0, ge=0)

    @model_validator(mode="after")
    def ordered(self) -> Autoscaling:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})")
        return self


class Speculative(Frozen):
    """Speculative decoding (shoal.config.speculative.SpeculativeConfig, the same keys)."""

    method: Literal["ngram", "draft_model"] | None = None
    model: str | None = None
    num_speculative_tokens: int = Field(8, ge=1)
    prompt_lookup_min: int = Field(3, ge=1)
    prompt_lookup_max: int = Field(5, ge=1)
    disable_by_batch_size: int = Field(8, ge=0)


class ModelDeployment(Frozen):
    """One served model: `name` is what clients ask for; `model` is a registry name, a .gguf file
    or a Hugging Face directory; `kv_cache` a fraction of free memory (0.3, 1.0) or a size
    (256MiB); `warm_spares` workers load the model but wait outside the router until a replica
    fails; with `autoscaling`, `replicas` is where it starts.

    Every other key is the EngineConfig field of that name (shoal.engine.config), and
    `engine_config()` is the config each replica runs, shipped to it whole. `share_weights` keeps
    the host's workers on one memory-mapped copy of the weights (CPU matrix multiplies are then
    slower than on a private repacked copy); `keep_quantized: false` dequantizes a GGUF model's
    quantized matrices instead of running them as they are; `tensor_parallel_size` ranks or
    `pipeline_parallel_size` stages make each replica that many processes (one replica to the
    router), `layers_per_stage` overriding the split planned from each node's measured speed and
    memory: ranks run on the replica's host; stages run there too with the local launcher, on nodes
    Ray picks (`resources` each) with the Ray launcher, or on `stage_servers` (`shoal stage`
    addresses, one per stage after the first, for one replica) with `spare_stage_servers` waiting
    to replace a lost one.

    `role` splits a model's prefill from its decode: a model may be listed once per role, and its
    `prefill` workers hand each stream, with its KV, to its `decode` (or `colocated`) workers
    after the first token (shoal.worker.kv_mobility). Autoscaling and warm spares are for
    colocated workers."""

    name: str = Field(min_length=1)
    model: str = DEFAULT_MODEL
    role: Role = "colocated"
    replicas: int = Field(1, ge=0)
    warm_spares: int = Field(0, ge=0)
    autoscaling: Autoscaling | None = None
    drain_grace_s: float = Field(30.0, ge=0)
    fallbacks: list[str] = []
    resources: Resources = Resources()
    kv_cache: str | float | None = None
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    num_threads: int | None = Field(None, ge=1)
    step_delay_ms: float = Field(0.0, ge=0)
    share_weights: bool = False
    keep_quantized: bool = True
    max_model_len: int | None = Field(None, ge=1)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(512, ge=1)
    background_step_tokens: int = Field(32, ge=1)
    speculative: Speculative = Speculative()
    enable_lora: bool = False
    max_loras: int = Field(1, ge=1)
    max_lora_rank: int = Field(16, ge=1)
    max_cpu_loras: int | None = Field(None, ge=1)
    lora_modules: list[str] = []
    lora_dir: str | None = None
    block_size: int = Field(16, ge=1)
    enable_prefix_caching: bool = True
    kv_events: bool = True
    batch_invariant: bool = True
    attention_kernel: Literal["auto", "rows", "tiles"] = "auto"
    itl_target_ms: float | None = Field(None, gt=0)
    seed: int | None = None
    tensor_parallel_size: int = Field(1, ge=1)
    enable_expert_parallel: bool = False
    pipeline_parallel_size: int = Field(1, ge=1)
    layers_per_stage: list[int] | None = None
    pipeline_wire_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    stage_servers: list[str] = []
    spare_stage_servers: list[str] = []
    spare_stages: int = Field(0, ge=0)
    pipeline_step_deadline_s: float = Field(30.0, gt=0)
    pipeline_ping_timeout_s: float = Field(10.0, gt=0)
    kv_tier_host_bytes: int = Field(0, ge=0)
    kv_tier_disk_bytes: int = Field(0, ge=0)
    kv_tier_dir: str | None = None
    kv_tier_shared: bool = False
    embedding_pooling: Literal["last", "mean"] = "last"
    embedding_normalize: bool = True

    @model_validator(mode="after")
    def replicas_within_bounds(self) -> ModelDeployment:
        bounds = self.autoscaling
        if bounds and not bounds.min_replicas <= self.replicas <= bounds.max_replicas:
            raise ValueError(
                f"replicas ({self.replicas}) must be within autoscaling.min_replicas "
                f"({bounds.min_replicas}) and max_replicas ({bounds.max_replicas})"
            )
        return self

    @model_validator(mode="after")
    def pools_have_a_fixed_size(self) -> ModelDeployment:
        if self.role != "colocated" and (self.autoscaling or self.warm_spares):
            raise ValueError(
                f"a {self.role} pool has a fixed size: autoscaling and warm_spares are for colocated workers"
            )
        return self

    def log_name(self, slot: int) -> str:
        """The file name of one replica's log."""
        role = "" if self.role == "colocated" else f"-{self.role}"
        return f"{self.name.replace('/', '_')}{role}-{slot}.log"

    def describe(self) -> str:
        """`name ×replicas`, with the role where it is not colocated."""
        return f"{self.name} ×{self.replicas}" + ("" if self.role == "colocated" else f" ({self.role})")

    @model_validator(mode="after")
    def one_kind_of_parallelism(self) -> ModelDeployment:
        if self.tensor_parallel_size > 1 and self.pipeline_parallel_size > 1:
            raise ValueError(
                "tensor_parallel_size and pipeline_parallel_size in one replica are not supported together yet"
            )
        if self.layers_per_stage is not None and (
            len(self.layers_per_stage) != self.pipeline_parallel_size or min(self.layers_per_stage) < 1
        ):
            raise ValueError(
                f"layers_per_stage needs one count of at least 1 per pipeline stage ({self.pipeline_parallel_size})"
            )
        if self.stage_servers and len(self.stage_servers) != self.pipeline_parallel_size - 1:
            raise ValueError(
                f"stage_servers needs one address per pipeline stage after the first "
                f"({self.pipeline_parallel_size - 1})"
            )
        if (self.stage_servers or self.spare_stage_servers) and (
            self.replicas + self.warm_spares > 1 or self.autoscaling or self.pipeline_parallel_size == 1
        ):
            raise ValueError(
                "stage_servers serve one pipeline replica: they need pipeline_parallel_size > 1, "
                "one replica, no warm spares and no autoscaling"
            )
        return self

    @field_validator("kv_cache")
    @classmethod
    def fraction_or_size(cls, value: str | float | None) -> str | float | None:
        if value is not None:
            parse_kv_cache(value)
        return value

    @model_validator(mode="after")
    def engine_accepts_it(self) -> ModelDeployment:
        self.engine_config()
        return self

    def kv_cache_bytes(self) -> int | None:
        """The KV budget in bytes, when it is given as a size."""
        return None if self.kv_cache is None else parse_kv_cache(self.kv_cache).get("kv_cache_bytes")

    def engine_config(self, stage_servers: tuple[str, ...] = ()) -> EngineConfig:
        """What each replica runs; `stage_servers` are pipeline stages a launcher started for it
        (the deployment's own stage_servers come first)."""
        fields = {f.name for f in dataclasses.fields(EngineConfig)} & set(type(self).model_fields)
        options = {name: getattr(self, name) for name in fields}
        options["speculative"] = self.speculative.model_dump()
        options["stage_servers"] = self.stage_servers or list(stage_servers)
        if self.kv_cache is not None:
            options.update(parse_kv_cache(self.kv_cache))
        return EngineConfig.from_dict(options)


class SupervisorSettings(Frozen):
    """A crashed worker is started again after restart_backoff_s, doubling with each crash in a row
    up to max_restart_backoff_s; one that ran healthy_after_s before crashing starts from the base."""

    restart_backoff_s: float = Field(1.0, gt=0)
    max_restart_backoff_s: float = Field(30.0, ge=0)
    healthy_after_s: float = Field(30.0, gt=0)


class DeploymentConfig(Frozen):
    """`launcher`: "local" (workers are subprocesses of `shoal serve`) or "ray" (Ray actors on the
    cluster at `ray_address`, placed by each model's `resources`)."""

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    launcher: Literal["local", "ray"] = "local"
    ray_address: str = "auto"
    state_dir: str = "~/.local/state/shoal"
    models: list[ModelDeployment] = [ModelDeployment(name=DEFAULT_MODEL, replicas=2)]
    router: RouterConfig = RouterConfig()
    supervisor: SupervisorSettings = SupervisorSettings()

    @field_validator("router")
    @classmethod
    def deployment_decides(cls, router: RouterConfig) -> RouterConfig:
        decided = {"host", "port", "workers", "models"} & router.model_fields_set
        if decided:
            raise ValueError(
                f"{', '.join(sorted(decided))}: set by the deployment (top-level host and port; "
                f"models with their fallbacks), not under router"
            )
        if router.processes > 1:
            raise ValueError("processes: `shoal serve` runs its router as one process (use `shoal router` for more)")
        return router

    @model_validator(mode="after")
    def consistent_models(self) -> DeploymentConfig:
        """A model is listed at most once per role, with one fallback chain; prefill workers have
        workers of the model to hand their streams to."""
        names = [m.name for m in self.models]
        entries = [(m.name, m.role) for m in self.models]
        duplicates = sorted({f"{n} ({r})" for n, r in entries if entries.count((n, r)) > 1})
        if duplicates:
            raise ValueError(f"models: {', '.join(duplicates)} defined more than once")
        for model in self.models:
            roles = {m.role for m in self.models if m.name == model.name}
            if model.role == "prefill" and not roles & {"decode", "colocated"}:
                raise ValueError(
                    f"models: the prefill workers of {model.name} hand their streams to decode or colocated "
                    f"workers of it; list some"
                )
            if any(m.fallbacks != model.fallbacks for m in self.models if m.name == model.name):
                raise ValueError(f"models: every role of {model.name} must have the same fallbacks")
            unknown = [f for f in model.fallbacks if f not in names or f == model.name]
            if unknown:
                raise ValueError(
                    f"models: the fallbacks of {model.name} must be other models of this "
                    f"deployment; not {', '.join(unknown)}"
                )
        return self

    @model_validator(mode="after")
    def kv_caches_fit_this_host(self) -> DeploymentConfig:
        """With the local launcher every replica runs here: a KV budget beyond this host's memory
        could never be allocated (on GPUs the engine checks it against the device)."""
        if self.launcher != "local":
            return self
        memory = psutil.virtual_memory().total
        for index, model in enumerate(self.models):
            budget = model.kv_cache_bytes()
            if budget and budget > memory and not model.device.startswith("cuda"):
                raise ValueError(
                    f"models.{index}.kv_cache: {model.kv_cache} is more than this host's memory "
                    f"({memory / 2**30:.1f} GiB)"
                )
        return self

    def router_config(self) -> RouterConfig:
        """The router's settings for this deployment: its address and the models' fallback chains
        (workers join it by registering)."""
        return self.router.model_copy(
            update={
                "host": self.host,
                "port": self.port,
                "models": {m.name: ModelSettings(fallbacks=m.fallbacks) for m in self.models},
            }
        )


def describe(error: ValidationError) -> str:
    """One line per bad key: its dotted path, then why."""
    lines = []
    for problem in error.errors():
        where = ".".join(str(part) for part in problem["loc"])
        why = "unknown key" if problem["type"] == "extra_forbidden" else problem["msg"].removeprefix("Value error, ")
        lines.append(f"{where}: {why}" if where else why)
    return "\n".join(lines)
