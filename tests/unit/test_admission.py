"""The HTTP admission gate: 413 for oversized bodies, 503 + Retry-After while draining or
overloaded, and an exact count of in-flight requests."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from shoal.worker.admission import AdmissionLimits, AdmissionMiddleware
from shoal.worker.drain import DrainState


def make_client(limits: AdmissionLimits, waiting: list[int], state: DrainState) -> httpx.AsyncClient:
    async def echo(request: Request) -> JSONResponse:
        body = await request.body()
        return JSONResponse({"bytes": len(body), "in_flight": state.in_flight})

    app = Starlette(routes=[Route("/v1/echo", echo, methods=["POST"]), Route("/health", echo, methods=["POST"])])
    app.add_middleware(AdmissionMiddleware, state=state, limits=limits, waiting_requests=lambda: waiting[0])
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://worker")


def run(coroutine):
    return asyncio.run(coroutine)


@pytest.fixture
def setup():
    state, waiting = DrainState(), [0]
    return state, waiting, make_client(AdmissionLimits(max_body_bytes=100, max_waiting_requests=3), waiting, state)


def test_bodies_within_the_limit_pass_and_are_counted_in_flight(setup):
    state, _, client = setup
    response = run(client.post("/v1/echo", content=b"x" * 100))
    assert response.json() == {"bytes": 100, "in_flight": 1} and state.in_flight == 0


def test_oversized_bodies_are_413_by_header_or_by_count(setup):
    state, _, client = setup
    declared = run(client.post("/v1/echo", content=b"x" * 101))

    async def chunks():
        for _ in range(5):
            yield b"x" * 30

    streamed = run(client.post("/v1/echo", content=chunks()))
    for response in (declared, streamed):
        assert response.status_code == 413 and "exceeds 100 bytes" in response.json()["error"]["message"]
    assert state.in_flight == 0


def test_overload_and_drain_are_503_with_retry_after(setup):
    state, waiting, client = setup
    waiting[0] = 3
    overloaded = run(client.post("/v1/echo", content=b"{}"))
    assert overloaded.status_code == 503 and overloaded.headers["retry-after"] == "5"
    assert "overloaded" in overloaded.json()["error"]["message"]
    waiting[0] = 0
    state.draining = True
    draining = run(client.post("/v1/echo", content=b"{}"))
    assert draining.status_code == 503 and "draining" in draining.json()["error"]["message"]
    assert run(client.post("/health", content=b"{}")).status_code == 200  # only /v1/ is gated
