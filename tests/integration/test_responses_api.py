"""/v1/responses on real routers in front of a real tiny worker, driven with the official openai
client: conversations continue with their full context across a router restart (SQLite) and
across routers, one of them killed (Redis); streaming; errors; ownership."""

from __future__ import annotations

import httpx
import openai
import pytest
import yaml

from shoal.router.admission.auth import key_hash
from tests.support.routers import start_router, stop
from tests.support.waiting import wait_for
from tests.support.workers import MODEL, free_port, scrape, start_worker, tiny_worker_args

SAMPLING = {"temperature": 0.8, "max_output_tokens": 12}
SEED = 7
INSTRUCTIONS = "Answer like a fish."


@pytest.fixture(scope="module")
def worker(tiny_model_dir, shoal_cache_dir):
    """One tiny worker at 10 ms a step: short turns stay quick, a 400-token stream takes seconds."""
    process, url = start_worker(
        tiny_worker_args(tiny_model_dir, MODEL, step_delay_ms=10),
        shoal_cache_dir,
    )
    yield url
    stop(process)


@pytest.fixture
def routers(worker, tmp_path):
    """Factory: a router over the worker with the given `responses` settings (and other config)."""
    started = []

    def start(responses: dict, **config) -> tuple:
        path = tmp_path / f"router-{len(started)}.yaml"
        path.write_text(yaml.safe_dump({"workers": [{"url": worker}], "state": responses, **config}))
        process, url = start_router(["--config", str(path)])
        started.append(process)
        return process, url

    yield start
    for process in started:
        if process.poll() is None:
            stop(process)


def client_for(url: str, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)


def turn(url: str, text: str, previous=None, **extra):
    return client_for(url).responses.create(
        model=MODEL,
        instructions=INSTRUCTIONS,
        input=text,
        previous_response_id=previous.id if previous else openai.omit,
        extra_body={"seed": SEED},
        **SAMPLING,
        **extra,
    )


def expect_full_context(worker: str, response, history: list[tuple[str, object]], text: str) -> None:
    """`response` is exactly what the worker answers, with the same seed, to a plain chat request
    with the whole conversation: instructions, every earlier (input, output) pair, the new input."""
    messages = [{"role": "system", "content": INSTRUCTIONS}]
    for earlier_input, earlier in history:
        messages += [{"role": "user", "content": earlier_input}, {"role": "assistant", "content": earlier.output_text}]
    messages.append({"role": "user", "content": text})
    plain = httpx.post(
        worker + "/v1/chat/completions",
        timeout=60,
        json={
            "model": MODEL,
            "messages": messages,
            "max_tokens": SAMPLING["max_output_tokens"],
            "temperature": SAMPLING["temperature"],
            "seed": SEED,
        },
    ).json()
    assert response.output_text == plain["choices"][0]["message"]["content"]
    assert response.usage.input_tokens == plain["usage"]["prompt_tokens"]
    assert response.usage.output_tokens == plain["usage"]["completion_tokens"]


def test_a_conversation_survives_a_router_restart_with_sqlite(worker, routers, tmp_path):
    settings = {"store": "sqlite", "sqlite_path": str(tmp_path / "state" / "responses.sqlite3")}
    router, url = routers(settings)
    first = turn(url, "Where do you live?")
    assert first.status in ("completed", "incomplete") and first.output_text
    stop(router)
    _, url = routers(settings)
    second = turn(url, "And your friends?", previous=first)
    assert second.previous_response_id == first.id
    expect_full_context(worker, second, [("Where do you live?", first)], "And your friends?")
    assert client_for(url).responses.retrieve(first.id) == first


def test_two_routers_share_conversations_through_redis(worker, routers, redis_url):
    settings = {"store": "redis", "redis_url": redis_url}
    router_a, url_a = routers(settings)
    _, url_b = routers(settings)
    first = turn(url_a, "Hello from A")
    second = turn(url_b, "Hello from B", previous=first)
    expect_full_context(worker, second, [("Hello from A", first)], "Hello from B")
    scratch = turn(url_b, "scratch")
    deleted = httpx.delete(f"{url_a}/v1/responses/{scratch.id}", timeout=10)
    assert deleted.json() == {"id": scratch.id, "object": "response", "deleted": True}
    assert httpx.get(f"{url_b}/v1/responses/{scratch.id}", timeout=10).status_code == 404
    router_a.kill()
    router_a.wait(timeout=30)
    third = turn(url_b, "A is gone", previous=second)
    expect_full_context(worker, third, [("Hello from A", first), ("Hello from B", second)], "A is gone")
    b = client_for(url_b)
    assert b.responses.retrieve(first.id) == first and b.responses.retrieve(second.id) == second
    [item] = b.responses.input_items.list(first.id).data
    assert item.role == "user" and item.content[0].text == "Hello from A"
    assert httpx.delete(f"{url_b}/v1/responses/{first.id}", timeout=10).json()["deleted"] is True
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as broken:
        turn(url_b, "and now?", previous=third)
    assert broken.value.body["param"] == "previous_response_id" and first.id in broken.value.body["message"]


def test_the_next_turn_goes_to_the_worker_holding_the_conversation_and_survives_losing_it(
    tiny_model_dir, shoal_cache_dir, tmp_path
):
    # 10 ms a step, like a real model's, so that timing noise does not swamp the routing estimates.
    workers = [
        start_worker(
            tiny_worker_args(tiny_model_dir, MODEL, step_delay_ms=10),
            shoal_cache_dir,
        )
        for _ in range(2)
    ]
    config = tmp_path / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "workers": [{"url": url} for _, url in workers],
                "state": {"store": "sqlite", "sqlite_path": str(tmp_path / "responses.sqlite3")},
            }
        )
    )
    router, url = start_router(["--config", str(config)])
    try:

        def raw_turn(text: str, previous=None):
            raw = client_for(url).responses.with_raw_response.create(
                model=MODEL,
                instructions=INSTRUCTIONS,
                input=text,
                extra_body={"seed": SEED},
                previous_response_id=previous.id if previous else openai.omit,
                **SAMPLING,
            )
            return raw.parse(), raw.headers["x-shoal-worker"]

        # Other conversations in between: the cost policy alone spreads them; the prefix index
        # brings each conversation's turns back to the worker that holds its history.
        first, home = raw_turn("Tell me about the sea.")
        raw_turn("Something else entirely, please.")
        second, second_home = raw_turn("And the waves?", previous=first)
        assert second_home == home
        holder = next(process for process, worker_url in workers if worker_url == home)
        holder.kill()
        holder.wait(timeout=30)
        third, third_home = raw_turn("Still there?", previous=second)
        survivor = next(worker_url for _, worker_url in workers if worker_url != home)
        assert third_home == survivor
        expect_full_context(
            survivor, third, [("Tell me about the sea.", first), ("And the waves?", second)], "Still there?"
        )
    finally:
        stop(router)
        for process, _ in workers:
            if process.poll() is None:
                stop(process)


def test_streamed_events_arrive_in_order_and_the_stored_response_is_the_final_one(worker, routers, tmp_path):
    _, url = routers({"sqlite_path": str(tmp_path / "responses.sqlite3")})
    first = turn(url, "Say something")
    events = list(turn(url, "Say more", previous=first, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert set(kinds[4:-4]) <= {"response.output_text.delta"}
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == final.output_text == events[-4].text
    assert final.id == events[0].response.id and final.previous_response_id == first.id
    assert client_for(url).responses.retrieve(final.id) == final
    expect_full_context(worker, final, [("Say something", first)], "Say more")


def test_output_text_logprobs_streamed_add_up_to_the_whole_ones(routers, tmp_path):
    """include message.output_text.logprobs with top_logprobs: the deltas' logprobs, in order, are
    the message's, and the same as a non-streamed response's for the same seed."""
    _, url = routers({"sqlite_path": str(tmp_path / "responses.sqlite3")})
    asked = dict(include=["message.output_text.logprobs"], top_logprobs=2, store=False)
    whole = turn(url, "Say something", **asked)
    [text] = whole.output[0].content
    assert len(text.logprobs) == whole.usage.output_tokens and all(len(e.top_logprobs) == 2 for e in text.logprobs)
    events = list(turn(url, "Say something", stream=True, **asked))
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    streamed = [entry.model_dump() for event in deltas for entry in event.logprobs]
    final = [e.model_dump() for e in events[-1].response.output[0].content[0].logprobs]
    assert streamed == final == [e.model_dump() for e in text.logprobs]


def test_truncation_auto_fits_a_conversation_over_the_context_and_disabled_refuses_it(routers, tmp_path):
    _, url = routers({"sqlite_path": str(tmp_path / "responses.sqlite3")})
    history = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": f"turn {i}: " + "a long story " * 12}
        for i in range(12)
    ]
    items = [*history, {"role": "user", "content": "and now?"}]
    with pytest.raises(openai.BadRequestError):
        client_for(url).responses.create(model=MODEL, input=items, max_output_tokens=8, store=False)
    fitted = client_for(url).responses.create(
        model=MODEL, input=items, max_output_tokens=8, store=False, truncation="auto"
    )
    assert fitted.status in ("completed", "incomplete") and fitted.truncation == "auto"
    assert fitted.usage.input_tokens + 8 <= 512  # the tiny model's context


def test_errors_ownership_and_options(routers, tmp_path):
    keys = {"alpha": "key-alpha", "beta": "key-beta"}
    _, url = routers(
        {"sqlite_path": str(tmp_path / "responses.sqlite3")},
        api_keys=[{"name": name, "sha256": key_hash(key)} for name, key in keys.items()],
    )
    alpha, beta = client_for(url, keys["alpha"]), client_for(url, keys["beta"])
    cut = alpha.responses.create(
        model=MODEL,
        input="count",
        max_output_tokens=5,
        metadata={"case": "cut"},
        extra_body={"seed": SEED, "ignore_eos": True},
    )
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.usage.output_tokens == 5 and cut.metadata == {"case": "cut"}
    with pytest.raises(openai.NotFoundError):
        beta.responses.retrieve(cut.id)
    with pytest.raises(openai.NotFoundError) as foreign:
        beta.responses.create(model=MODEL, input="mine?", previous_response_id=cut.id)
    assert foreign.value.body["param"] == "previous_response_id"
    assert httpx.get(f"{url}/v1/responses/{cut.id}", timeout=10).status_code == 401
    with pytest.raises(openai.BadRequestError) as bad:
        alpha.responses.create(model=MODEL, input=[{"role": "user", "content": [{"type": "input_image"}]}])
    assert bad.value.body["param"] == "input[0].content[0].type"
    with pytest.raises(openai.NotFoundError):
        alpha.responses.create(model="no-such-model", input="x")
    unstored = alpha.responses.create(model=MODEL, input="forget me", max_output_tokens=3, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        alpha.responses.retrieve(unstored.id)
    items = alpha.responses.input_items.list(cut.id, order="asc", limit=1)
    assert [item.content[0].text for item in items.data] == ["count"]
    headers = {"authorization": f"Bearer {keys['alpha']}", "content-type": "application/json"}
    for raw in (b"{not json", b"[]", b'{"model": "tiny", "input": "x", "temperature": 9}'):
        response = httpx.post(url + "/v1/responses", content=raw, headers=headers, timeout=10)
        assert response.status_code == 400 and response.json()["error"]["code"] == 400
    assert httpx.delete(f"{url}/v1/responses/resp_nope", headers=headers, timeout=10).status_code == 404
    assert alpha.responses.retrieve(cut.id) == cut


def test_a_client_leaving_a_stream_aborts_its_request_on_the_worker(worker, routers, tmp_path):
    _, url = routers({"sqlite_path": str(tmp_path / "responses.sqlite3")})
    abort = "shoal:request_success_total[('finished_reason', 'abort')]"
    aborted_before = scrape(worker).get(abort, 0)
    body = {"model": MODEL, "input": "go on and on", "max_output_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/responses", json=body, timeout=60) as response:
        next(line for line in response.iter_lines() if "response.output_text.delta" in line)
    wait_for(lambda: scrape(worker).get(abort, 0) == aborted_before + 1)
    assert scrape(worker)["shoal:num_requests_running"] == 0


def test_an_unreachable_store_is_a_503_and_the_router_goes_on(routers):
    _, url = routers({"store": "redis", "redis_url": f"redis://127.0.0.1:{free_port()}/0"})
    body = {"model": MODEL, "input": "x", "max_output_tokens": 2}
    for response in (
        httpx.post(url + "/v1/responses", json=body, timeout=60),
        httpx.post(url + "/v1/responses", json={**body, "previous_response_id": "resp_x"}, timeout=60),
        httpx.get(url + "/v1/responses/resp_x", timeout=60),
    ):
        assert response.status_code == 503 and response.json()["error"]["code"] == 503
    assert httpx.post(url + "/v1/responses", json={**body, "store": False}, timeout=60).status_code == 200
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
    assert httpx.post(url + "/v1/chat/completions", json=chat, timeout=60).status_code == 200
