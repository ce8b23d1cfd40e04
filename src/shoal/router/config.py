"""Router configuration: one frozen pydantic model, from flags or a YAML/JSON file. Unknown keys
are errors that name the key."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

# The policies the router has (shoal.router.placement.policies builds exactly these).
POLICY_NAMES = (
    "round_robin",
    "least_outstanding_tokens",
    "power_of_two",
    "cache_aware",
    "session_affinity",
    "cost",
    "sglang_cache_aware",
    "llm_d",
    "llm_d_latency",
    "dynamo_kv",
    "ray_prefix_affinity",
)


class Frozen(BaseModel):
    """Settings: immutable, and unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    @classmethod
    def from_file(cls, path: str | Path, **overrides):
        """Reads YAML (or JSON, a subset); `overrides` (from flags) win over the file."""
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: a {cls.__name__} file must be a mapping")
        return cls(**{**raw, **overrides})


class StaticWorker(Frozen):
    """A worker the router polls. `models` are asked from its /v1/models when not given."""

    url: str
    models: list[str] | None = None


class LatencyTargets(Frozen):
    """Time to first token and time per output token a request should get, in milliseconds (None: no
    target). The router places a request where its targets are predicted to be met, and refuses
    sheddable work at once (429) when no worker can meet them."""

    ttft_ms: float | None = Field(None, gt=0)
    tpot_ms: float | None = Field(None, gt=0)

    @property
    def given(self) -> bool:
        return self.ttft_ms is not None or self.tpot_ms is not None


class ModelSettings(Frozen):
    """Per served model: `fallbacks` is the chain tried in order when this model cannot serve;
    `targets`, its requests' latency targets unless their key or headers set them."""

    fallbacks: list[str] = []
    targets: LatencyTargets = LatencyTargets()


class RateLimits(Frozen):
    """Per-key limits, and per end user of the key (a request's safety_identifier, else its user);
    None is unlimited."""

    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)
    end_user_requests_per_minute: int | None = Field(None, ge=1)
    end_user_tokens_per_minute: int | None = Field(None, ge=1)


class ApiKey(RateLimits):
    """A client key, stored as the hex SHA-256 of the key (never the key itself). `weight`: its share
    of the slots while others wait too (admission's fair shares; each end user of the key weighs
    as much), 1 by default."""

    name: str | None = None
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")
    weight: float = Field(1.0, gt=0)
    targets: LatencyTargets = LatencyTargets()  # its requests' latency targets unless headers set them


def per_priority(name: str, values: dict[str, int], minimum: int) -> dict[str, int]:
    """Checks a setting given per priority class: exactly the three classes, each at least `minimum`."""
    expected = {"critical", "standard", "sheddable"}
    if set(values) != expected or any(v < minimum for v in values.values()):
        raise ValueError(f"{name} needs a value of at least {minimum} for exactly {sorted(expected)}")
    return values


class AdmissionSettings(Frozen):
    """Requests in flight per healthy worker before the rest queue; queue bound per priority class;
    how long a request may wait (its x-shoal-deadline-s header may shorten it); the max_tokens a
    degraded sheddable request is cut to."""

    max_in_flight_per_worker: int = Field(64, ge=1)
    queue_limits: dict[str, int] = {"critical": 256, "standard": 128, "sheddable": 32}
    queue_timeout_s: float = Field(30.0, gt=0)
    retry_after_s: int = Field(2, ge=1)
    degrade_max_tokens: int | None = Field(64, ge=1)

    @field_validator("queue_limits")
    @classmethod
    def every_class(cls, limits: dict[str, int]) -> dict[str, int]:
        return per_priority("queue_limits", limits, minimum=0)


class FailoverSettings(Frozen):
    """Retries and migrations. A request that fails before its first byte is retried on another
    worker, up to `attempts[priority]` workers in all, sleeping base × 2^k (capped, half of it
    jittered) between tries; critical requests then fall back along the model's chain. A stream
    migrates at most `max_migrations` times. A stream with no event (token or keep-alive) for
    clamp(token_deadline_factor × expected, min, max) is taken as hung, where expected is the larger
    of the worker's expected inter-token latency and the step time it last stated in a keep-alive
    (before its first token: token_deadline_max_s); so is one whose keep-alive says its engine has
    been on a step for longer than token_deadline_factor × the step's stated time (at least the min;
    not capped by the max, which only bounds a step of unknown length). While no worker of its model
    can take it, a new request (which then falls back along the model's chain, or gets 503) or a
    stream to continue waits up to wait_for_capacity_s, never longer than its x-shoal-deadline-s."""

    attempts: dict[str, int] = {"critical": 5, "standard": 3, "sheddable": 2}
    backoff_base_s: float = Field(0.05, ge=0)
    backoff_max_s: float = Field(1.0, ge=0)
    max_migrations: int = Field(3, ge=0)
    wait_for_capacity_s: float = Field(10.0, ge=0)
    token_deadline_factor: float = Field(20.0, gt=0)
    token_deadline_min_s: float = Field(2.0, gt=0)
    token_deadline_max_s: float = Field(30.0, gt=0)

    @field_validator("attempts")
    @classmethod
    def every_class(cls, attempts: dict[str, int]) -> dict[str, int]:
        return per_priority("attempts", attempts, minimum=1)

    def attempts_for(self, priority: str) -> int:
        """Batch work (below the three classes) gets the sheddable class's attempts."""
        return self.attempts.get(priority, self.attempts["sheddable"])


class BreakerSettings(Frozen):
    """Consecutive failures that open a worker's breaker; how long it stays open before a probe
    (doubling after each failed probe, up to max_open_s)."""

    failure_threshold: int = Field(5, ge=1)
    open_s: float = Field(5.0, gt=0)
    max_open_s: float = Field(60.0, gt=0)


class OutlierSettings(Frozen):
    """A worker whose time to first token or inter-token latency exceeds factor × the median of the
    workers serving its model on its engine (with at least min_samples samples each, among at least
    min_workers workers) is ejected for ejection_s × the number of times it was ejected; at most
    max_ejected_fraction of a model's workers are ejected at once."""

    factor: float = Field(3.0, gt=1)
    min_workers: int = Field(3, ge=3)
    min_samples: int = Field(20, ge=1)
    ejection_s: float = Field(30.0, gt=0)
    max_ejected_fraction: float = Field(0.5, ge=0, le=1)


class HealthSettings(Frozen):
    """Workers heartbeat (registered) or are polled (static); one silent for missed_heartbeats ×
    heartbeat_interval_s is down (its streams migrate) until it answers again, and a registered one
    silent for lease_s is forgotten. Shoal workers also get a canary generation every
    canary_interval_s: a 200 from /health does not prove that generation works."""

    heartbeat_interval_s: float = Field(1.0, gt=0)
    missed_heartbeats: int = Field(2, ge=1)
    lease_s: float = Field(3.0, gt=0)
    canary_interval_s: float = Field(10.0, gt=0)
    canary_timeout_s: float = Field(5.0, gt=0)
    breaker: BreakerSettings = BreakerSettings()
    outliers: OutlierSettings = OutlierSettings()


class StateSettings(Frozen):
    """Where the router keeps what it stores (responses, chat completions, batches, uploaded files'
    records): `sqlite` (one file on this host, survives a restart; `~` is expanded and the directory
    created), `redis` (shared by every router pointing at it) or `none` (nothing is stored, so
    nothing can be continued, retrieved or batched). What is stored is stored before the client
    gets its end. `sqlite_synchronous`: `full` syncs the file to disk with each write (it survives
    a power cut), `normal` only at checkpoints (it survives the router being killed, not a power
    cut; about 2 ms less per write). Uploaded files' contents live in `files_dir` (a directory
    every router of a group shares when they share a Redis store), at most `max_file_bytes` each.
    Work the routers share (batches, background responses) is run by one router at a time under a
    lease of `lease_s` in the store, renewed while it runs; another router takes over work whose
    lease ran out (its router died). Routers look for work to take every `work_poll_interval_s`."""

    store: Literal["sqlite", "redis", "none"] = "sqlite"
    sqlite_path: str = "~/.local/state/shoal/state.sqlite3"
    sqlite_synchronous: Literal["full", "normal"] = "full"
    redis_url: str = "redis://127.0.0.1:6379/0"
    files_dir: str = "~/.local/state/shoal/files"
    max_file_bytes: int = Field(200 << 20, ge=1)
    lease_s: float = Field(10.0, gt=0)
    work_poll_interval_s: float = Field(1.0, gt=0)


class BatchSettings(Frozen):
    """How a router runs batches (batch_api): at most `max_in_flight` batch requests at once, each
    admitted only on idle capacity (the batch class: never queued, refused while anyone waits); a
    refused request is tried again after `retry_s`."""

    max_in_flight: int = Field(8, ge=1)
    retry_s: float = Field(0.5, gt=0)


class ResumableStreamsSettings(Frozen):
    """With `store: redis`, every single-choice stream gets event ids and a journal in Redis
    (shoal.router.streams.journal), and a client that reconnects with `Last-Event-ID` to any router
    sharing `redis_url` gets the rest of the stream. Token ids are written every `flush_tokens`
    tokens (one Redis round trip each); a journal expires `ttl_s` after its last write."""

    store: Literal["none", "redis"] = "none"
    redis_url: str = "redis://127.0.0.1:6379/0"
    flush_tokens: int = Field(16, ge=1)
    ttl_s: float = Field(600.0, ge=1)


class TracingSettings(Frozen):
    """Spans go to `otlp_endpoint` (OTLP over HTTP, e.g. http://collector:4318/v1/traces) when set,
    else to the one OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT names, if any; the latest `keep_traces`
    traces stay in memory for the dashboard either way. A request that brings a traceparent is
    traced as it says; of the others, the first `traces_per_second` each second are traced, then
    `sample_ratio` of the rest. Each traced request costs the router about 0.1 ms of CPU, one not
    traced next to nothing: a quiet router traces everything, a busy one a bounded trickle."""

    otlp_endpoint: str | None = None
    keep_traces: int = Field(500, ge=1)
    traces_per_second: float = Field(100.0, ge=0.0)
    sample_ratio: float = Field(0.01, ge=0.0, le=1.0)


class RouterConfig(Frozen):
    """`processes` > 1 runs the router as that many processes sharing its port (router_processes;
    `shoal router` only), which then need a fixed port. `follow_kv_events` reads what each worker
    caches from its KV events where it publishes them (shoal.router.fleet.kv_event_feeds); off, or for a
    worker that publishes none, the router guesses it from what it sent (shoal.router.placement.prefix_index)."""

    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    processes: int = Field(1, ge=1, le=64)
    workers: list[StaticWorker] = []
    policy: str = "cost"
    policy_options: dict = {}
    follow_kv_events: bool = True
    models: dict[str, ModelSettings] = {}
    load_poll_interval_s: float = Field(0.5, gt=0)
    health: HealthSettings = HealthSettings()
    connect_timeout_s: float = Field(2.0, gt=0)
    read_timeout_s: float = Field(300.0, gt=0)
    chars_per_token: float = Field(4.0, gt=0)
    default_decode_tokens: int = Field(256, ge=1)
    cluster_secret_env: str = "SHOAL_CLUSTER_SECRET"
    admin_token_env: str = "SHOAL_ADMIN_TOKEN"
    api_keys: list[ApiKey] = []
    api_keys_env: str | None = "SHOAL_API_KEYS"
    default_rate_limits: RateLimits = RateLimits()
    admission: AdmissionSettings = AdmissionSettings()
    failover: FailoverSettings = FailoverSettings()
    state: StateSettings = StateSettings()
    batches: BatchSettings = BatchSettings()
    resumable_streams: ResumableStreamsSettings = ResumableStreamsSettings()
    max_body_bytes: int = Field(4 << 20, ge=1024)
    max_header_bytes: int = Field(16 << 10, ge=1024)
    tracing: TracingSettings = TracingSettings()
    seed: int | None = None

    @field_validator("policy")
    @classmethod
    def known_policy(cls, name: str) -> str:
        if name not in POLICY_NAMES:
            raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICY_NAMES)}")
        return name

    @model_validator(mode="after")
    def group_needs_a_port(self) -> RouterConfig:
        if self.processes > 1 and self.port == 0:
            raise ValueError("processes > 1 share one port: give a port other than 0")
        return self
