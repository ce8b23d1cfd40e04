"""Router configuration: one frozen pydantic model, from flags or a YAML/JSON file. Unknown keys
are errors that name the key."""
from __future__ import annotations

from pathlib import Path

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
    max_body_bytes: int = Field(4 << 20, ge=1024)
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
