"""A Messages stream outlives its router: two routers share a stream journal in Redis; the router
relaying a stream is killed (kill -9) mid-way, and the client reconnects to the other one with the
Last-Event-ID it last got. The events it gets then continue the same message (no second
message_start, the open block goes on), and the whole is the message of a run without the kill."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest
import yaml

from tests.support.routers import start_router, stop
from tests.support.workers import MODEL, start_worker, tiny_worker_args

BODY = {
    "model": MODEL,
    "max_tokens": 120,
    "messages": [{"role": "user", "content": "tell me a long story"}],
    "stream": True,
    "seed": 7,
    "temperature": 0.8,
    "ignore_eos": True,
}


@pytest.fixture
def routers(tiny_model_dir, shoal_cache_dir, redis_url, tmp_path):
    """([router url, its process] x 2) over one worker at 10 ms a step, sharing the journal."""
    worker, worker_url = start_worker(tiny_worker_args(tiny_model_dir, MODEL, step_delay_ms=10), shoal_cache_dir)
    config = tmp_path / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "workers": [{"url": worker_url}],
                "state": {"store": "none"},
                "resumable_streams": {"store": "redis", "redis_url": redis_url, "flush_tokens": 4},
            }
        )
    )
    started = [start_router(["--config", str(config)]) for _ in range(2)]
    yield [(url, process) for process, url in started]
    for process, _ in started:
        if process.poll() is None:
            stop(process)
    stop(worker)


def events(url: str, last_event_id: str | None = None) -> Iterator[tuple[str | None, str, dict]]:
    """(SSE id, event name, data) per event of a Messages stream."""
    headers = {"last-event-id": last_event_id} if last_event_id else {}
    with httpx.stream("POST", url + "/v1/messages", json=BODY, headers=headers, timeout=60) as response:
        assert response.status_code == 200, response.read()
        event_id, name = None, None
        for line in response.iter_lines():
            if line.startswith("id: "):
                event_id = line[4:]
            elif line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                yield event_id, name, json.loads(line[6:])
                event_id = None


def message(received: list[tuple[str | None, str, dict]]) -> dict:
    """The blocks' texts by index, the stop reason and output tokens, and the count of each event."""
    texts: dict[int, str] = {}
    stop_reason, output_tokens, counts = None, None, {}
    for _, name, data in received:
        counts[name] = counts.get(name, 0) + 1
        if name == "content_block_delta":
            texts[data["index"]] = texts.get(data["index"], "") + data["delta"].get("text", "")
        elif name == "message_delta":
            stop_reason, output_tokens = data["delta"]["stop_reason"], data["usage"]["output_tokens"]
    return {"texts": texts, "stop_reason": stop_reason, "output_tokens": output_tokens, "counts": counts}


def test_a_messages_stream_resumes_on_another_router_after_kill_9(routers):
    (first, first_process), (second, _) = routers
    reference = message(list(events(second)))
    assert reference["output_tokens"] == 120 and reference["stop_reason"] == "max_tokens"
    received, last_id = [], None
    with pytest.raises(httpx.TransportError):  # the connection dies with its router
        for event_id, name, data in events(first):
            received.append((event_id, name, data))
            last_id = event_id or last_id
            if sum(n == "content_block_delta" for _, n, _ in received) == 30:
                first_process.kill()
    assert last_id is not None and "#" in last_id
    resumed = list(events(second, last_event_id=last_id))
    assert resumed[0][1] == "content_block_delta"  # the open text block goes on: no second start
    whole = message(received + resumed)
    assert whole["texts"] == reference["texts"] and whole["output_tokens"] == 120
    assert whole["counts"]["message_start"] == 1 and whole["counts"]["message_stop"] == 1


def test_a_bad_last_event_id_is_an_anthropic_400(routers):
    (url, _), _ = routers
    for bad in ("not an id", "chatcmpl-x:1:2#1.text.zero."):
        refused = httpx.post(url + "/v1/messages", json=BODY, headers={"last-event-id": bad}, timeout=30)
        assert refused.status_code == 400 and refused.json()["type"] == "error", refused.text
        assert refused.json()["error"]["type"] == "invalid_request_error"
    unknown = httpx.post(url + "/v1/messages", json=BODY, headers={"last-event-id": "chatcmpl-x:1:2#1.text.0."})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
