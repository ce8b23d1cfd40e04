"""The /v1/responses endpoints of the router app, with the front door's dispatch recorded instead
of sent to workers: what the model is sent, the session each turn is routed by, what is passed on."""

from __future__ import annotations

import json

import pytest
from starlette.responses import JSONResponse, StreamingResponse
from starlette.testclient import TestClient

from shoal.router.app import create_router_app
from shoal.router.config import RouterConfig
from shoal.router.streams.proxy import error_response


class RecordingDispatch:
    """Stands in for FrontDoor.dispatch: records each chat request and answers "reply N" for the
    N-th one (as JSON or as a chat stream), or the refusal it was given."""

    def __init__(self):
        self.dispatched: list[tuple[dict, dict]] = []
        self.refusal = None

    async def __call__(self, body, headers, path, chat, client):
        assert (path, chat) == ("/v1/chat/completions", True)
        self.dispatched.append((body, dict(headers)))
        if self.refusal is not None:
            return self.refusal
        text = f"reply {len(self.dispatched)}"
        usage = {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
        if not body["stream"]:
            return JSONResponse(
                {
                    "id": "chatcmpl-1",
                    "model": body["model"],
                    "usage": usage,
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}
                    ],
                },
                headers={"x-shoal-worker": "w1"},
            )

        async def events():
            for event in (
                {"choices": [{"delta": {"role": "assistant", "content": ""}}]},
                {"choices": [{"delta": {"content": text}, "finish_reason": "stop"}]},
                {"choices": [], "usage": usage},
            ):
                yield b"data: " + json.dumps({"id": "chatcmpl-1", "model": body["model"], **event}).encode() + b"\n\n"
            yield b"data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"x-shoal-worker": "w1"})


@pytest.fixture
def service(tmp_path):
    """(test client, recorded dispatch) for a router app without workers, storing in SQLite."""
    app = create_router_app(
        RouterConfig(state={"sqlite_path": str(tmp_path / "state.sqlite3"), "files_dir": str(tmp_path / "files")})
    )
    app.state.front_door.dispatch = dispatch = RecordingDispatch()
    with TestClient(app) as client:
        yield client, dispatch


def test_each_turn_sends_the_whole_chain_and_is_routed_by_the_conversation(service):
    client, dispatch = service
    first = client.post("/v1/responses", json={"model": "m", "input": "one", "instructions": "old"}).json()
    second = client.post(
        "/v1/responses", json={"model": "m", "input": "two", "previous_response_id": first["id"], "stream": True}
    )
    assert second.headers["x-shoal-worker"] == "w1"
    second = json.loads(second.text.strip().split("\n")[-1].removeprefix("data: "))["response"]
    third = client.post(
        "/v1/responses",
        json={
            "model": "m",
            "input": [{"role": "user", "content": "three"}],
            "instructions": "new",
            "previous_response_id": second["id"],
        },
    )
    assert third.headers["x-shoal-worker"] == "w1"
    assert [headers["x-shoal-session"] for _, headers in dispatch.dispatched] == [first["id"]] * 3
    assert dispatch.dispatched[2][0]["messages"] == [
        {"role": "system", "content": "new"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "reply 1"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "reply 2"},
        {"role": "user", "content": "three"},
    ]
    assert client.get(f"/v1/responses/{second['id']}").json() == second


def test_a_refusal_from_the_front_door_is_passed_on_unchanged(service):
    client, dispatch = service
    dispatch.refusal = error_response(429, "slow down", "rate_limit_error", headers={"retry-after": "3"})
    for stream in (False, True):
        refused = client.post("/v1/responses", json={"model": "m", "input": "x", "stream": stream})
        assert refused.status_code == 429 and refused.headers["retry-after"] == "3"
        assert refused.json()["error"]["message"] == "slow down"


def test_unknown_ids_and_bad_bodies_are_openai_errors(service):
    client, dispatch = service
    for method, path in (
        ("GET", "/v1/responses/resp_x"),
        ("DELETE", "/v1/responses/resp_x"),
        ("GET", "/v1/responses/resp_x/input_items"),
    ):
        missing = client.request(method, path)
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
    unknown = client.post("/v1/responses", json={"model": "m", "input": "x", "previous_response_id": "resp_x"})
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "previous_response_id"
    bad = client.post("/v1/responses", json={"model": "m", "input": [{"role": "user", "content": 5}]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "input[0].content"
    stored = client.post("/v1/responses", json={"model": "m", "input": "x"}).json()
    paged = client.get(f"/v1/responses/{stored['id']}/input_items", params={"limit": "0"})
    assert paged.status_code == 400 and paged.json()["error"]["param"] == "limit"
    assert len(dispatch.dispatched) == 1  # refused requests never reach the workers
