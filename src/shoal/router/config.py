"""Router configuration: one frozen pydantic model, from flags or a YAML/JSON file. Unknown keys
are errors that name the key."""
from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class StaticWorker(Frozen):
    """A worker the router polls. `models` are asked from its /v1/models when not given."""

    url: str
    models: list[str] | None = None


class ModelSettings(Frozen):
    """Per served model: `fallbacks` is the chain tried in order when this model cannot serve."""

    fallbacks: list[str] = []


class RateLimits(Frozen):
    """Per-key limits; None is unlimited."""

    requests_per_minute: int | None = Field(None, ge=1)
    tokens_per_minute: int | None = Field(None, ge=1)


class ApiKey(RateLimits):
    """A client key, stored as the hex SHA-256 of the key (never the key itself)."""

    name: str | None = None
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class AdmissionSettings(Frozen):
    """Requests in flight per healthy worker before the rest queue; queue bound per priority class;
    how long a request may wait; the max_tokens a degraded sheddable request is cut to."""

    max_in_flight_per_worker: int = Field(64, ge=1)
    queue_limits: dict[str, int] = {"critical": 256, "standard": 128, "sheddable": 32}
    queue_timeout_s: float = Field(30.0, gt=0)
    retry_after_s: int = Field(2, ge=1)
    degrade_max_tokens: int | None = Field(64, ge=1)

    @field_validator("queue_limits")
    @classmethod
    def every_class(cls, limits: dict[str, int]) -> dict[str, int]:
        expected = {"critical", "standard", "sheddable"}
        if set(limits) != expected or any(v < 0 for v in limits.values()):
            raise ValueError(f"queue_limits needs non-negative limits for exactly {sorted(expected)}")
        return limits


class FailoverSettings(Frozen):
    """max_attempts bounds the workers one request may try (first placement included) and the
    migrations of one stream; a stream with no event for token_deadline_s is taken as hung."""

    max_attempts: int = Field(3, ge=1)
    token_deadline_s: float = Field(10.0, gt=0)


class ResponsesSettings(Frozen):
    """Where /v1/responses keeps stored responses: `sqlite` (one file on this host, survives a
    restart; `~` is expanded and the directory created), `redis` (shared by every router pointing at
    it) or `none` (nothing is stored, so nothing can be continued or retrieved)."""

    store: Literal["sqlite", "redis", "none"] = "sqlite"
    sqlite_path: str = "~/.local/state/shoal/responses.sqlite3"
    redis_url: str = "redis://127.0.0.1:6379/0"


class RouterConfig(Frozen):
    host: str = "127.0.0.1"
    port: int = Field(8080, ge=0, le=65535)
    workers: list[StaticWorker] = []
    policy: str = "cost"
    policy_options: dict = {}
    models: dict[str, ModelSettings] = {}
    load_poll_interval_s: float = Field(0.5, gt=0)
    unhealthy_after_failures: int = Field(3, ge=1)
    heartbeat_lease_s: float = Field(3.0, gt=0)
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
    responses: ResponsesSettings = ResponsesSettings()
    max_body_bytes: int = Field(4 << 20, ge=1024)
    max_header_bytes: int = Field(16 << 10, ge=1024)
    seed: int | None = None

    @field_validator("policy")
    @classmethod
    def known_policy(cls, name: str) -> str:
        from shoal.router.policies import POLICIES

        if name not in POLICIES:
            raise ValueError(f"unknown policy {name!r}; choose one of {sorted(POLICIES)}")
        return name

    @classmethod
    def from_file(cls, path: str | Path, **overrides) -> "RouterConfig":
        """Reads YAML (or JSON, a subset); `overrides` (from flags) win over the file."""
        raw = yaml.safe_load(Path(path).read_text()) or {}
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: the router config must be a mapping")
        return cls(**{**raw, **overrides})
