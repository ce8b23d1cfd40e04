"""Schema-driven fuzzing of a real worker process: every operation of its OpenAPI schema gets
valid and invalid inputs from schemathesis; none may cause a 5xx (the canary's 503, which means
"no token within your deadline", excepted), every /v1/ error is OpenAI-shaped, and afterwards the
worker still gives the same correct answer it gave before."""

from __future__ import annotations

from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.generation.modes import GenerationMode

from tests.support.workers import MODEL, start_worker, tiny_worker_args

REFERENCE = {"model": MODEL, "prompt": "fuzz me", "max_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def fuzzed_worker(tiny_model_dir, shoal_cache_dir):
    """(url, the reference completion's token ids before any fuzzing). A short context window keeps
    every valid generation short, and makes over-long prompts common."""
    process, url = start_worker(tiny_worker_args(tiny_model_dir, MODEL, "--max-model-len", "256"), shoal_cache_dir)
    before = httpx.post(url + "/v1/completions", json=REFERENCE, timeout=60).json()["choices"][0]["token_ids"]
    yield url, before
    process.kill()
    process.wait(timeout=30)


def check_response(case, statuses: Counter) -> None:
    response = case.call(timeout=120)
    statuses[(case.operation.path, response.status_code)] += 1
    path = case.operation.path
    assert response.status_code < 500 or (path == "/health/canary" and response.status_code == 503), (
        case.method,
        path,
        response.status_code,
        response.text[:500],
        case.body,
    )
    if path.startswith("/v1/") and response.status_code >= 400:
        assert "error" in response.json(), (response.status_code, response.text[:300], case.headers)
        error = response.json()["error"]
        # OpenAI's own code where it has one (an over-long prompt), else the status, as vLLM answers.
        expected_code = (
            "context_length_exceeded"
            if error["type"] == "invalid_request_error"
            and ("context window" in error["message"] or "accepts at most" in error["message"])
            else response.status_code
        )
        assert error["code"] == expected_code and error["message"] and error["type"], error


@pytest.mark.parametrize("mode", list(GenerationMode))
def test_no_input_breaks_the_worker(fuzzed_worker, mode):
    schema = schemathesis.openapi.from_url(fuzzed_worker[0] + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/health/canary"}
    statuses: Counter = Counter()
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and not (len(operation.body) or len(operation.query)):
            continue  # nothing to get wrong

        @settings(
            max_examples=80 if operation.method == "post" else 20,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(operation.as_strategy(generation_mode=mode), st.integers(0, 3))
        def fuzz(case, draw):
            if draw < 3 and isinstance(case.body, dict):
                case.body["model"] = MODEL  # past the model check, into the engine
            check_response(case, statuses)

        fuzz()
    if mode is GenerationMode.POSITIVE:  # the engine itself was exercised, not just validation
        assert statuses[("/v1/completions", 200)] and statuses[("/v1/chat/completions", 200)], statuses


def test_the_worker_still_serves_the_same_answer(fuzzed_worker):
    url, before = fuzzed_worker
    assert httpx.get(url + "/ready").status_code == 200
    after = httpx.post(url + "/v1/completions", json=REFERENCE, timeout=60).json()["choices"][0]["token_ids"]
    assert after == before and len(after) == 12
    load = httpx.get(url + "/load").json()
    assert load["running"] == 0 and load["waiting"] == 0 and load["free_kv_blocks"] == load["num_kv_blocks"]
