"""A stream on speculating workers (prompt lookup and a predicted output, or a draft model) whose
worker is killed (kill -9) mid-way goes on on another worker, token for token: drafts never change
the tokens, so the migrated stream is the stream of a run without the failure, and of a worker that
does not speculate."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest

from tests.support.failover_trio import failover_trio
from tests.support.routers import stop
from tests.support.workers import MODEL, scrape, start_worker, tiny_worker_args

MAX_TOKENS = 150


@pytest.fixture(params=["ngram", "draft_model"])
def trio(request, tiny_model_dir, tiny_draft_model_dir, shoal_cache_dir, tmp_path):
    """(router url, {worker url: process}, method): workers speculating by the method, at 10 ms a step."""
    speculative = {"method": request.param, "disable_by_batch_size": 64}
    if request.param == "draft_model":
        speculative["model"] = str(tiny_draft_model_dir)
    args = tiny_worker_args(tiny_model_dir, MODEL, "--speculative", json.dumps(speculative), step_delay_ms=10)
    for url, processes in failover_trio(args, shoal_cache_dir, tmp_path):
        yield url, processes, request.param


def request(prediction: str) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": "tell me a long story"}],
        "max_tokens": MAX_TOKENS,
        "seed": 7,
        "temperature": 0.8,
        "ignore_eos": True,
        "prediction": {"type": "content", "content": prediction},
    }


def streamed_ids(url: str, body: dict, kill_after: int, processes: dict) -> list[int]:
    """The token ids of a request streamed through the router; its worker is killed once
    `kill_after` token ids have arrived."""
    ids = []
    with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=120) as response:
        assert response.status_code == 200, response.read()
        worker = response.headers["x-shoal-worker"]
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            for choice in event["choices"]:
                ids += choice.get("token_ids") or []
            if kill_after is not None and len(ids) >= kill_after:
                os.kill(processes[worker].pid, signal.SIGKILL)
                kill_after = None
    return ids


def test_a_speculating_stream_survives_kill_9_of_its_worker(trio, tiny_model_dir, shoal_cache_dir):
    url, processes, method = trio
    plain_process, plain_url = start_worker(tiny_worker_args(tiny_model_dir, MODEL, "--seed", "1"), shoal_cache_dir)
    try:  # the tokens of a worker that does not speculate
        body = request("")
        reference = httpx.post(plain_url + "/v1/chat/completions", json={**body, "stream": False}, timeout=120).json()
    finally:
        stop(plain_process)
    expected = reference["choices"][0]["token_ids"]
    assert len(expected) == MAX_TOKENS
    # With prompt lookup the client predicts the output (drafts that will be kept); a draft model
    # drafts itself.
    prediction = reference["choices"][0]["message"]["content"] if method == "ngram" else ""
    faulty = streamed_ids(url, request(prediction), kill_after=40, processes=processes)
    assert faulty == expected
    migrations = sum(v for k, v in scrape(url).items() if k.startswith("shoal_router_migrations_total"))
    assert migrations == 1
    alive = [worker for worker, process in processes.items() if process.poll() is None]
    kept = sum(scrape(worker)["shoal:spec_decode_num_accepted_tokens_total"] for worker in alive)
    assert kept > 0  # the worker that went on drafted (from the prediction, or its draft model) and kept drafts
