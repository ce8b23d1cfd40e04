"""A worker's LoRA adapters over HTTP, as vLLM has them: a request names an adapter as its `model`;
/v1/models lists each with the base model as `parent`; POST /v1/load_lora_adapter and
/v1/unload_lora_adapter change them at run time.

Run-time loads read only from under the engine's `lora_dir` (none without one), and where the
worker has the cluster secret they need it as a bearer token. A bad adapter is a 400 naming the
file and the reason; the worker goes on serving."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from shoal.engine.async_engine import AsyncLLMEngine
from shoal.errors import InvalidRequestError, ModelNotFoundError
from shoal.model.lora_adapter import LoraAdapterError
from shoal.protocol.worker_load import LoraLoad
from shoal.worker.cluster_bearer import authorize


class LoadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    sha256: str | None = Field(None, pattern="^[0-9a-fA-F]{64}$")


class UnloadLoraAdapter(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)


def adapter_named(engine: AsyncLLMEngine, base: str, model: str) -> str | None:
    """The LoRA adapter a request's `model` names (None: the base model); ModelNotFoundError (404)
    naming it when this worker serves neither."""
    if model == base:
        return None
    loras = engine.engine.loras
    if loras is not None and model in loras.known:
        return model
    served = [base, *sorted(loras.known)] if loras is not None else [base]
    raise ModelNotFoundError(f"model {model!r} is not served here; this worker serves {served}", param="model")


async def adapter_held(engine: AsyncLLMEngine, base: str, model: str) -> str | None:
    """adapter_named, and that adapter held in memory: read again off the engine thread where the
    engine had given it back (AsyncLLMEngine.hold_lora_adapter)."""
    lora = adapter_named(engine, base, model)
    if lora is not None:
        await engine.hold_lora_adapter(lora)
    return lora


def lora_report(engine: AsyncLLMEngine) -> LoraLoad | None:
    """The LoRA part of the load report (None where LoRA is off): from the engine's latest stats."""
    counters = engine.stats.lora
    if counters is None:
        return None
    return LoraLoad(
        adapters=list(counters.known),
        held=list(counters.held),
        capacity=engine.engine.config.held_loras,
        loading=sorted(engine.lora_reads),
        loads=counters.loads,
        load_s=counters.load_s,
        on_demand=engine.engine.config.lora_dir is not None,
    )


def model_cards(engine: AsyncLLMEngine, base: str, max_model_len: int) -> list[dict]:
    """/v1/models' entries for the adapters, each with the base model as parent."""
    loras = engine.engine.loras
    if loras is None:
        return []
    return [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "shoal",
            "root": known.path,
            "parent": base,
            "max_model_len": max_model_len,
        }
        for name, known in sorted(loras.known.items())
    ]


def confined(lora_dir: str | None, path: str) -> Path:
    """`path` (relative to lora_dir, or absolute) when it lies under lora_dir; InvalidRequestError otherwise."""
    if lora_dir is None:
        raise InvalidRequestError(
            "this worker loads no LoRA adapters at run time (it has no lora_dir)", param="lora_path"
        )
    root = Path(lora_dir).resolve()
    resolved = (root / path).resolve()
    if not resolved.is_relative_to(root):
        raise InvalidRequestError(f"lora_path {path!r} is outside this worker's lora_dir", param="lora_path")
    return resolved


def add_lora_routes(app: FastAPI, engine: AsyncLLMEngine) -> None:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapter, request: Request) -> dict:
        authorize(request, "loading and unloading LoRA adapters")
        path = confined(engine.engine.config.lora_dir, body.lora_path)
        try:
            await engine.load_lora_adapter(body.lora_name, str(path), body.sha256)
        except LoraAdapterError as exc:
            raise InvalidRequestError(str(exc), param="lora_path") from None
        return {"object": "lora_adapter", "name": body.lora_name, "path": str(path), "loaded": True}

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapter, request: Request) -> dict:
        authorize(request, "loading and unloading LoRA adapters")
        await engine.unload_lora_adapter(body.lora_name)
        return {"object": "lora_adapter", "name": body.lora_name, "loaded": False}
