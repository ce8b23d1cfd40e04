"""One replica behind OpenAI-compatible HTTP: /v1/completions, /v1/chat/completions, /v1/models;
/health, /ready and /health/canary; /load (the router's load report) and /metrics (Prometheus)."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec
from fastapi import FastAPI, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from shoal.engine.async_engine import AsyncLLMEngine
from shoal.engine.calibration import Calibration
from shoal.engine.observer import ObserverGroup
from shoal.engine.sampling_params import SamplingParams
from shoal.errors import ModelNotFoundError, ShoalError, error_body
from shoal.model.families import family_named
from shoal.observability.tracing import FASTAPI_TELEMETRY, Tracing
from shoal.protocol.admission_class import scheduling_class
from shoal.protocol.keep_alive import REQUEST_HEADER as KEEP_ALIVE_HEADER
from shoal.protocol.prefix_keys import canonical_chat
from shoal.protocol.worker_load import CalibrationFigures, Role, WorkerLoad, encode
from shoal.worker.admission import AdmissionLimits, AdmissionMiddleware
from shoal.worker.chat_prompt import chat_prompt
from shoal.worker.conversation_truncation import fitted
from shoal.worker.drain import DrainState
from shoal.worker.embeddings import EmbeddingRequest, embedding_response
from shoal.worker.heartbeat import RouterHeartbeat
from shoal.worker.kv_event_stream import add_kv_event_routes, announce_prompt, completion_prompt
from shoal.worker.kv_mobility import KVMobility
from shoal.worker.lora_adapters import adapter_held, add_lora_routes, lora_report, model_cards
from shoal.worker.metrics import WorkerMetrics
from shoal.worker.protocol import ChatCompletionRequest, CompletionRequest
from shoal.worker.reasoning_use import ReasoningUse
from shoal.worker.request_tracing import EngineSpans, WorkerRequestSpan
from shoal.worker.responses import respond
from shoal.worker.served_request import ServedRequest
from shoal.worker.tool_calling import ToolUse

CANARY_PROMPT = "ping"


def error_response(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, status, kind, param), status_code=status)


@dataclass(frozen=True)
class RouterLink:
    """Where this worker registers: the router's URL, the URL it advertises, the cluster secret."""

    url: str
    advertise_url: str
    secret: str


def create_app(
    engine: AsyncLLMEngine,
    model_name: str,
    drain: DrainState | None = None,
    calibration: Calibration | None = None,
    limits: AdmissionLimits | None = None,
    routers: Sequence[RouterLink] = (),
    tracing: Tracing | None = None,
    role: Role = "colocated",
    kv_peer_host: str | None = None,
    advertise_host: str | None = None,
) -> FastAPI:
    """The worker's ASGI app. Invariants: a client's mistake is a 4xx for that request only; an
    engine failure is a 500 for the requests it hit only. The worker registers with each of
    `routers` (redundant routers serve the same workers) and heartbeats its load report to each.
    Requests are traced with `tracing` (in memory only, if not given). It serves in `role`, with a
    KV peer on `kv_peer_host` (reached at `advertise_host`) where it can have one (kv_mobility)."""
    drain = drain or DrainState()
    tracing = tracing or Tracing("shoal-worker")

    figures = msgspec.convert(calibration.as_dict(), CalibrationFigures) if calibration else None

    def load_report() -> WorkerLoad:
        """The compact load report for routers (from the engine's latest stats snapshot)."""
        stats = engine.stats
        return WorkerLoad(
            server="shoal",
            model=model_name,
            max_model_len=max_model_len,
            draining=drain.draining,
            running=stats.num_running,
            waiting=stats.num_waiting,
            max_num_seqs=engine.engine.config.max_num_seqs,
            outstanding_prefill_tokens=stats.outstanding_prefill_tokens,
            outstanding_decode_tokens=stats.outstanding_decode_tokens,
            free_kv_blocks=stats.num_free_blocks,
            num_kv_blocks=stats.num_kv_blocks,
            kv_cache_budget_bytes=engine.engine.kv_cache_budget_bytes,
            block_size=stats.block_size,
            kv_capacity_tokens=stats.max_cached_tokens,
            free_kv_tokens=stats.free_cached_tokens,
            kv_cache_usage=stats.kv_cache_usage,
            prefill_tokens_per_s=stats.prefill_tokens_per_s,
            decode_tokens_per_s=stats.decode_tokens_per_s,
            decode_step_s=stats.decode_step_s,
            decode_step_noise=stats.decode_step_noise,
            decode_tokens_per_step=stats.decode_tokens_per_step,
            lora=lora_report(engine),
            draft_tokens=stats.spec_decode_num_draft_tokens,
            accepted_draft_tokens=stats.spec_decode_num_accepted_tokens,
            longest_step_s=engine.longest_step_s(),
            capability=calibration.capability if calibration else None,
            calibration=figures,
            generated_tokens=stats.generation_tokens,
            role=role,
            kv_peer=kv.kv_peer,
            kv_tier_tokens=stats.kv_tier.capacity_tokens if stats.kv_tier else None,
            kv_tier_load_tokens_per_s=stats.kv_tier.load_tokens_per_s if stats.kv_tier else None,
        )

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if kv_peer_host is not None:
            kv.open_peer(engine, kv_peer_host, advertise_host)
        tasks = [
            asyncio.create_task(RouterHeartbeat(r.url, r.advertise_url, model_name, r.secret, load_report).run())
            for r in routers
        ]
        yield
        for task in tasks:
            task.cancel()
        kv.close()
        tracing.shutdown()

    app = FastAPI(title="shoal worker", lifespan=lifespan, telemetry=FASTAPI_TELEMETRY)
    app.add_middleware(
        AdmissionMiddleware,
        state=drain,
        limits=limits or AdmissionLimits(),
        waiting_requests=lambda: engine.stats.num_waiting,
    )
    metrics = WorkerMetrics(engine, model_name)
    kv = KVMobility(role, drain, metrics, tracing)
    engine_spans = EngineSpans(tracing)
    engine.engine.observer = ObserverGroup(metrics, engine_spans)
    tokenizer = engine.engine.tokenizer
    max_model_len = engine.engine.max_model_len
    canary_prompt = tokenizer.encode(CANARY_PROMPT) or [0]
    family = family_named(engine.engine.checkpoint.config.architecture)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = ".".join(str(p) for p in first.get("loc", ())[1:]) or None
        if first.get("type") == "extra_forbidden":
            return error_response(400, f"unknown or unsupported parameter `{param}`", param=param)
        where = f"`{param}`: " if param else ""
        return error_response(400, f"invalid request: {where}{first.get('msg', 'malformed body')}", param=param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind=kind)

    @app.exception_handler(ShoalError)
    async def refused(_: Request, exc: ShoalError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.get("/health")
    async def health() -> dict:
        """The process is alive (not that it can generate: see /health/canary)."""
        return {}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        return JSONResponse({"ready": not drain.draining}, status_code=503 if drain.draining else 200)

    @app.get("/health/canary")
    async def canary(timeout_s: float = Query(10.0, gt=0, le=300)) -> JSONResponse:
        """Proves generation works: one greedy token, admitted ahead of queued work, within timeout_s."""
        started = time.monotonic()
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        try:
            async with asyncio.timeout(timeout_s):
                async for output in engine.generate(
                    canary_prompt, params, f"canary-{uuid.uuid4().hex}", scheduling="probe"
                ):
                    token_ids = output.outputs[0].token_ids
        except TimeoutError:
            return JSONResponse({"ok": False, "error": f"no token within {timeout_s} s"}, status_code=503)
        except Exception as exc:
            return JSONResponse({"ok": False, "error": f"{type(exc).__name__}: {exc}"}, status_code=503)
        return JSONResponse({"ok": True, "token_ids": token_ids, "latency_s": time.monotonic() - started})

    @app.get("/load")
    async def load() -> Response:
        return Response(encode(load_report()), media_type="application/json")

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/debug/traces/{trace_id}")
    async def trace_spans(trace_id: str) -> dict:
        """This worker's spans of a trace (the router assembles the whole trace from these)."""
        return {"trace_id": trace_id, "spans": tracing.recent.spans(trace_id)}

    @app.get("/v1/models")
    async def models() -> dict:
        return {
            "object": "list",
            "data": [
                {
                    "id": model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "shoal",
                    "max_model_len": max_model_len,
                },
                *model_cards(engine, model_name, max_model_len),
            ],
        }

    add_lora_routes(app, engine)
    add_kv_event_routes(app, engine)

    def check_model(body: EmbeddingRequest) -> None:
        if body.model != model_name:
            raise ModelNotFoundError(
                f"model {body.model!r} is not served here; this worker serves {model_name!r}", param="model"
            )

    def traced(request: Request) -> WorkerRequestSpan:
        return WorkerRequestSpan(tracing, engine_spans, request.headers, request.url.path, model_name)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        lora = await adapter_held(engine, model_name, body.model)
        prompt_ids, canonical, token_ends = completion_prompt(tokenizer, body.prompt)
        announce_prompt(engine, canonical, canonical.text, token_ends, prompt_ids, body.prompt_cache_key, lora)
        served = ServedRequest(
            body,
            prompt_ids,
            body.max_tokens,
            body.logprobs,
            chat=False,
            model_name=body.model,
            max_model_len=max_model_len,
            trace=traced(request),
            kv=kv,
            handoff=kv.handoffs_for(request.headers, body),
            keep_alive=KEEP_ALIVE_HEADER in request.headers,
            scheduling=scheduling_class(request.headers),
            lora=lora,
        )
        return await respond(engine, served)

    @app.post("/v1/embeddings")
    async def embeddings(body: EmbeddingRequest) -> dict:
        check_model(body)
        prompts = body.token_ids(tokenizer)
        vectors = await engine.embed(prompts)
        normalize = engine.engine.config.embedding_normalize
        return embedding_response(body, vectors, sum(map(len, prompts)), model_name, normalize)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        lora = await adapter_held(engine, model_name, body.model)
        tool_use = ToolUse.of(body, tokenizer, family.harmony)

        token_ends: dict[str, list[int]] = {}

        def prompt_of(conversation: ChatCompletionRequest) -> tuple[str, list[int]]:
            text = chat_prompt(tokenizer, conversation, tool_use)
            ids, token_ends[text] = tokenizer.encode_with_ends(text, add_special_tokens=False)
            return text, ids

        body, text, prompt_ids = fitted(body, prompt_of, max_model_len)
        if engine.engine.kv_events is not None:
            raw = await request.json()  # the prefix keys are the router's, of the body as sent
            canonical = canonical_chat(raw["messages"], raw.get("tools"), raw.get("tool_choice"))
            announce_prompt(engine, canonical, text, token_ends[text], prompt_ids, body.prompt_cache_key, lora)
        reasoning = ReasoningUse.of(body, family.reasoning_markers, tokenizer, text, family.harmony)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        served = ServedRequest(
            body,
            prompt_ids,
            body.max_completion_tokens or body.max_tokens,
            logprobs,
            chat=True,
            model_name=body.model,
            max_model_len=max_model_len,
            trace=traced(request),
            tool_use=tool_use,
            kv=kv,
            handoff=kv.handoffs_for(request.headers, body),
            keep_alive=KEEP_ALIVE_HEADER in request.headers,
            reasoning=reasoning,
            scheduling=scheduling_class(request.headers),
            predicted=tuple(tokenizer.encode(body.prediction.text(), add_special_tokens=False))
            if body.prediction
            else (),
            lora=lora,
        )
        return await respond(engine, served)

    return app
