"""Operators change a fleet's LoRA adapters through the router (admin token): POST
/v1/load_lora_adapter and /v1/unload_lora_adapter are passed to every shoal worker of the fleet, or
of one base model, or to the one `worker` names, with the cluster secret; the answer gives each
worker's. Requests route to an adapter once a worker's load report names it.

A load for the fleet or a base model also enters the adapter in the router's catalog
(shoal.router.lora_catalog), so workers that lack it later (restarted, joined, or past their
max_cpu_loras) are given it when requests need it there; with `on_demand: true` it is only entered
there, and each worker loads it when a request first needs it. An unload for the fleet or a base
model takes it out of the catalog."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from shoal.router.fleet.membership import Membership
from shoal.router.fleet.worker_state import WorkerState
from shoal.router.lora_catalog import AdapterSource, LoraCatalog, passed_on
from shoal.router.streams.proxy import error_response


class FleetLoad(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    sha256: str | None = None
    model: str | None = None  # the base model whose workers load it (None: every worker)
    worker: str | None = None  # one worker's id (None: all of them)
    on_demand: bool = False  # catalogued only: loaded where and when requests need it


class FleetUnload(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str = Field(min_length=1)
    model: str | None = None
    worker: str | None = None


def targets(membership: Membership, model: str | None, worker: str | None) -> list[WorkerState]:
    """The shoal workers a change goes to: available ones, of the base model and worker named."""
    return [
        state
        for state in membership.workers.values()
        if state.load_source == "shoal"
        and state.available
        and (model is None or model in state.base_models)
        and (worker is None or state.worker_id == worker)
    ]


def add_lora_admin_routes(
    app: FastAPI, membership: Membership, catalog: LoraCatalog, authorized, secret: str | None, unauthorized
) -> None:
    """`authorized(request)`: whether it carries the admin token; `unauthorized(what)`: the 401."""

    async def change(request: Request, path: str, body: dict, workers: list[WorkerState]) -> JSONResponse:
        results = await passed_on(membership.session, workers, path, body, secret)
        failed = [r["status"] for r in results.values() if r["status"] != 200]
        return JSONResponse(
            {"lora_name": body["lora_name"], "workers": results}, status_code=failed[0] if failed else 200
        )

    def chosen(body: FleetLoad | FleetUnload) -> list[WorkerState] | Response:
        workers = targets(membership, body.model, body.worker)
        if not workers:
            return error_response(404, "no available shoal worker matches the change", "not_found_error")
        return workers

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: FleetLoad, request: Request) -> Response:
        if not authorized(request):
            return unauthorized("admin token")
        if body.on_demand and body.worker is not None:
            return error_response(
                400,
                "on_demand catalogues an adapter for the fleet or a base model, not for one worker",
                "invalid_request_error",
                "on_demand",
            )
        workers = chosen(body)
        if isinstance(workers, Response):
            return workers
        bases = {body.model} if body.model else set().union(*(w.base_models for w in workers))
        if body.worker is not None:
            source = None
        elif len(bases) == 1:
            source = AdapterSource(bases.pop(), body.lora_path, body.sha256)
        else:
            return error_response(
                400,
                f"the workers serve several base models ({sorted(bases)}): name one as model",
                "invalid_request_error",
                "model",
            )
        if body.on_demand:
            await catalog.add(body.lora_name, source)
            return JSONResponse({"lora_name": body.lora_name, "on_demand": True, "workers": {}})
        passed = body.model_dump(include={"lora_name", "lora_path", "sha256"}, exclude_none=True)
        answer = await change(request, "/v1/load_lora_adapter", passed, workers)
        if source is not None and answer.status_code == 200:  # catalogued once every worker read it
            await catalog.add(body.lora_name, source)
        return answer

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: FleetUnload, request: Request) -> Response:
        if not authorized(request):
            return unauthorized("admin token")
        workers = chosen(body)
        if isinstance(workers, Response):
            return workers
        if body.worker is None:
            await catalog.remove(body.lora_name)
        return await change(request, "/v1/unload_lora_adapter", body.model_dump(include={"lora_name"}), workers)
