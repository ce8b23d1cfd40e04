"""Files and batches on real routers in front of a real tiny worker, driven with the official
openai client: a batch's lines run (chat, completions, embeddings, responses), malformed lines fail
alone, the output and error files come back in line order; a batch survives kill -9 of its router
with no line lost or answered twice; cancel and an expired window report what finished; bad input
is refused with the right status."""

from __future__ import annotations

import io
import json
import time

import httpx
import openai
import pytest

from shoal.router.admission.auth import key_hash
from tests.support.routers import RouterFactory, stop
from tests.support.waiting import wait_for
from tests.support.workers import MODEL, scrape, start_worker, tiny_worker_args

KEYS = {"alpha": "key-alpha", "beta": "key-beta"}
FINISHED = ("completed", "failed", "expired", "cancelled")


@pytest.fixture(scope="module")
def worker(tiny_model_dir, shoal_cache_dir):
    """At 20 ms a step, a 24-token answer takes about half a second: long enough to kill or cancel
    a batch in the middle."""
    process, url = start_worker(tiny_worker_args(tiny_model_dir, MODEL, step_delay_ms=20), shoal_cache_dir)
    yield url
    stop(process)


@pytest.fixture
def router(worker, tmp_path):
    """Factory: (re)starts a router over the worker on one SQLite state file and files directory."""
    state = {
        "store": "sqlite",
        "sqlite_path": str(tmp_path / "state.sqlite3"),
        "files_dir": str(tmp_path / "files"),
        "lease_s": 2.0,
        "work_poll_interval_s": 0.2,
    }
    routers = RouterFactory(
        tmp_path,
        {
            "workers": [{"url": worker}],
            "state": state,
            "batches": {"max_in_flight": 4},
            "health": {"canary_interval_s": 3600},  # the worker's request count is the batch's alone
            "api_keys": [{"name": name, "sha256": key_hash(key)} for name, key in KEYS.items()],
        },
    )
    yield routers.start
    routers.stop_all()


def client_for(url: str, name: str = "alpha") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEYS[name], max_retries=0, timeout=60)


def chat_line(custom_id: str, text: str, max_tokens: int = 4, **extra) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens, **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def upload(client: openai.OpenAI, lines: list, purpose: str = "batch"):
    data = b"".join((line if isinstance(line, bytes) else json.dumps(line).encode()) + b"\n" for line in lines)
    return client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose=purpose)


def finished(client: openai.OpenAI, batch_id: str, timeout_s: float = 120):
    wait_for(lambda: client.batches.retrieve(batch_id).status in FINISHED, timeout_s)
    return client.batches.retrieve(batch_id)


def jsonl(client: openai.OpenAI, file_id: str | None) -> list[dict]:
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()] if file_id else []


def test_a_batch_runs_every_line_and_fails_malformed_ones_alone(router, worker):
    _, url = router()
    alpha = client_for(url)
    lines = [
        chat_line("a", "one", temperature=0),
        b'{"custom_id": "broken", "method": "POST", "url": ',  # not JSON
        chat_line("b", "two", temperature=0),
        chat_line("a", "again"),  # custom_id used before
        chat_line("c", "three", model="no-such-model"),  # answered, with a 404
        {**chat_line("d", "four"), "url": "/v1/completions"},  # not this batch's endpoint
        chat_line("e", "five", stream=True),
    ]
    source = upload(alpha, lines)
    assert source.purpose == "batch" and source.bytes > 0
    batch = alpha.batches.create(
        input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h", metadata={"run": "1"}
    )
    assert batch.status == "validating" and batch.metadata == {"run": "1"}
    done = finished(alpha, batch.id)
    assert done.status == "completed" and done.completed_at and done.in_progress_at and done.finalizing_at
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (7, 2, 5), jsonl(
        alpha, done.error_file_id
    )
    outputs, errors = jsonl(alpha, done.output_file_id), jsonl(alpha, done.error_file_id)
    assert [o["custom_id"] for o in outputs] == ["a", "b"]
    for output, text in zip(outputs, ["one", "two"]):
        direct = httpx.post(
            worker + "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 4, "temperature": 0},
            timeout=60,
        ).json()
        answer = output["response"]["body"]
        assert output["response"]["status_code"] == 200 and output["response"]["request_id"]
        assert answer["choices"][0]["message"]["content"] == direct["choices"][0]["message"]["content"]
    assert [(e["custom_id"], (e["error"] or {}).get("code")) for e in errors] == [
        (None, "invalid_json"),
        ("a", "duplicate_custom_id"),
        ("c", None),
        ("d", "invalid_url"),
        ("e", "invalid_body"),
    ]
    assert errors[2]["response"]["status_code"] == 404
    assert alpha.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert [b.id for b in alpha.batches.list()] == [batch.id]
    assert alpha.batches.list().data[0].status == "completed"
    # Another key sees none of it.
    beta = client_for(url, "beta")
    for call in (lambda: beta.batches.retrieve(batch.id), lambda: beta.files.content(done.output_file_id)):
        with pytest.raises(openai.NotFoundError):
            call()
    assert list(beta.batches.list()) == [] and list(beta.files.list()) == []


@pytest.mark.parametrize(
    "endpoint,body,check",
    [
        ("/v1/completions", {"prompt": "Hello", "max_tokens": 3}, lambda b: b["object"] == "text_completion"),
        ("/v1/embeddings", {"input": ["a fish", "a bird"]}, lambda b: len(b["data"]) == 2),
        ("/v1/responses", {"input": "Hi", "max_output_tokens": 3}, lambda b: b["object"] == "response"),
    ],
)
def test_each_endpoint_runs_in_a_batch(router, endpoint, body, check):
    _, url = router()
    alpha = client_for(url)
    lines = [
        {"custom_id": f"r{i}", "method": "POST", "url": endpoint, "body": {"model": MODEL, **body}} for i in range(3)
    ]
    done = finished(
        alpha,
        alpha.batches.create(input_file_id=upload(alpha, lines).id, endpoint=endpoint, completion_window="24h").id,
    )
    outputs = jsonl(alpha, done.output_file_id)
    assert done.status == "completed" and [o["custom_id"] for o in outputs] == ["r0", "r1", "r2"]
    assert all(o["response"]["status_code"] == 200 and check(o["response"]["body"]) for o in outputs)


@pytest.mark.parametrize("store", ["sqlite", "redis"])
def test_a_batch_survives_kill_9_of_its_router_with_no_line_lost_or_run_twice(router, worker, store, request):
    """With SQLite the router is started again on the file; with Redis (a router group's store)
    another router, on the same Redis and files directory, takes the batch over."""
    shared = (
        {"state": {"store": "redis", "redis_url": request.getfixturevalue("redis_url")}} if store == "redis" else {}
    )
    process, url = router(shared)
    alpha = client_for(url)
    total = 40
    lines = [chat_line(f"q{i}", f"question {i}", max_tokens=24, ignore_eos=True) for i in range(total)]
    batch = alpha.batches.create(
        input_file_id=upload(alpha, lines).id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    before = scrape(worker).get("shoal:e2e_request_latency_seconds_count", 0)
    wait_for(lambda: alpha.batches.retrieve(batch.id).request_counts.completed >= 8, 120)
    process.kill()  # kill -9 mid-batch: up to max_in_flight requests were running
    process.wait(timeout=30)
    _, url = router(shared)
    alpha = client_for(url)
    done = finished(alpha, batch.id, 240)
    assert done.status == "completed" and done.request_counts.completed == total
    outputs = jsonl(alpha, done.output_file_id)
    assert [o["custom_id"] for o in outputs] == [f"q{i}" for i in range(total)]  # each once, in line order
    assert all(o["response"]["body"]["usage"]["completion_tokens"] == 24 for o in outputs)
    ran = scrape(worker)["shoal:e2e_request_latency_seconds_count"] - before
    assert total <= ran <= total + 4  # only the lines cut off by the kill ran again


def test_cancel_and_an_expired_window_report_what_finished(router):
    _, url = router()
    alpha = client_for(url)
    lines = [chat_line(f"q{i}", f"question {i}", max_tokens=24, ignore_eos=True) for i in range(60)]
    source = upload(alpha, lines)
    cancelled = alpha.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="24h")
    wait_for(lambda: alpha.batches.retrieve(cancelled.id).request_counts.completed >= 2, 120)
    asked = alpha.batches.cancel(cancelled.id)
    assert asked.status == "cancelling" and asked.cancelling_at
    done = finished(alpha, cancelled.id)
    assert done.status == "cancelled" and done.cancelled_at
    finished_lines = jsonl(alpha, done.output_file_id)
    unfinished = jsonl(alpha, done.error_file_id)
    assert 2 <= len(finished_lines) < 60 and len(finished_lines) + len(unfinished) == 60
    assert {e["error"]["code"] for e in unfinished} == {"batch_cancelled"}
    assert done.request_counts.completed == len(finished_lines) and done.request_counts.failed == len(unfinished)
    with pytest.raises(openai.APIStatusError) as again:
        alpha.batches.cancel(cancelled.id)
    assert again.value.status_code == 409
    started = time.monotonic()
    expired = finished(
        alpha, alpha.batches.create(input_file_id=source.id, endpoint="/v1/chat/completions", completion_window="3s").id
    )
    assert expired.status == "expired" and expired.expired_at and time.monotonic() - started < 60
    assert expired.request_counts.completed < 60
    codes = {e["error"]["code"] for e in jsonl(alpha, expired.error_file_id)}
    assert codes == {"batch_expired"}


def test_bad_files_and_batches_are_refused_with_the_right_status(router):
    _, url = router({"state": {"max_file_bytes": 4096}})
    alpha = client_for(url)
    with pytest.raises(openai.APIStatusError) as large:
        upload(alpha, [chat_line(f"q{i}", "x" * 200) for i in range(40)])
    assert large.value.status_code == 413
    boundary = "shoal-test-boundary"

    def chunked_upload():  # no Content-Length: the size is counted as the body arrives
        yield f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'.encode()
        yield f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'.encode()
        for _ in range(100):
            yield b"x" * 1024
        yield f"\r\n--{boundary}--\r\n".encode()

    unsized = httpx.post(
        url + "/v1/files",
        content=chunked_upload(),
        headers={
            "authorization": f"Bearer {KEYS['alpha']}",
            "content-type": f"multipart/form-data; boundary={boundary}",
        },
        timeout=30,
    )
    assert unsized.status_code == 413, unsized.text
    assert list(alpha.files.list()) == []  # nothing was left behind
    with pytest.raises(openai.BadRequestError) as purpose:
        upload(alpha, [chat_line("a", "x")], purpose="fine-tune")
    assert purpose.value.body["param"] == "purpose"
    source = upload(alpha, [chat_line("a", "x")])
    for params, status, param in [
        ({"input_file_id": "file-nope", "endpoint": "/v1/chat/completions"}, 404, "input_file_id"),
        ({"input_file_id": source.id, "endpoint": "/v1/images"}, 400, "endpoint"),
        (
            {"input_file_id": source.id, "endpoint": "/v1/chat/completions", "completion_window": "forever"},
            400,
            "completion_window",
        ),
    ]:
        response = httpx.post(
            url + "/v1/batches",
            json={"completion_window": "24h", **params},
            headers={"authorization": f"Bearer {KEYS['alpha']}"},
            timeout=10,
        )
        assert response.status_code == status and response.json()["error"]["param"] == param, response.text
    for call in (lambda: alpha.batches.retrieve("batch_nope"), lambda: alpha.files.retrieve("file-nope")):
        with pytest.raises(openai.NotFoundError):
            call()
    assert alpha.files.delete(source.id).deleted
    with pytest.raises(openai.NotFoundError):
        alpha.files.content(source.id)
