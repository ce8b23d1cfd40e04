"""/v1/messages and /v1/messages/count_tokens on a real router in front of a real tiny worker,
driven with the official anthropic client (authenticating with x-api-key): plain and streamed
messages equal a plain chat completion of the same conversation and seed, stop sequences, tool use
over two turns, token counts, and refusals in Anthropic's shape."""

from __future__ import annotations

import json

import anthropic
import httpx
import pytest
import yaml

from shoal.router.admission.auth import key_hash
from tests.support.routers import start_router, stop
from tests.support.workers import MODEL, start_worker, tiny_worker_args

KEY = "messages-test-key"
SEED = 7
SYSTEM = "Answer like a fish."
ASK = [{"role": "user", "content": "Where do you live?"}]
CLOCK = {
    "name": "get_time",
    "description": "The time in a zone",
    "input_schema": {
        "type": "object",
        "properties": {"zone": {"enum": ["UTC", "CET"]}},
        "required": ["zone"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def fleet(long_tiny_model_dir, shoal_cache_dir, tmp_path_factory):
    """(router url, worker url): the tiny model with room for a tools prompt, behind a router that
    takes one API key."""
    worker, worker_url = start_worker(tiny_worker_args(long_tiny_model_dir, MODEL), shoal_cache_dir)
    config = tmp_path_factory.mktemp("messages") / "router.yaml"
    config.write_text(
        yaml.safe_dump({"workers": [{"url": worker_url}], "api_keys": [{"sha256": key_hash(KEY), "name": "tester"}]})
    )
    router, url = start_router(["--config", str(config)])
    yield url, worker_url
    stop(router)
    stop(worker)


def client(url: str, key: str = KEY) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=url, api_key=key, max_retries=0, timeout=60)


def create(url: str, extra: dict | None = None, **fields) -> anthropic.types.Message:
    """A message with the seed (and the `extra` fields this SDK has no argument for: temperature)."""
    return client(url).messages.create(
        model=MODEL, max_tokens=fields.pop("max_tokens", 16), extra_body={"seed": SEED, **(extra or {})}, **fields
    )


def text_of(message: anthropic.types.Message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


def test_a_message_is_the_chat_completion_of_its_conversation(fleet):
    url, worker = fleet
    message = create(url, {"temperature": 0.8}, system=SYSTEM, messages=ASK)
    plain = httpx.post(
        worker + "/v1/chat/completions",
        timeout=60,
        json={
            "model": MODEL,
            "messages": [{"role": "system", "content": SYSTEM}, *ASK],
            "max_tokens": 16,
            "temperature": 0.8,
            "seed": SEED,
        },
    ).json()
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL and [block.type for block in message.content] == ["text"]
    assert text_of(message) == plain["choices"][0]["message"]["content"]
    assert message.stop_reason == {"length": "max_tokens", "stop": "end_turn"}[plain["choices"][0]["finish_reason"]]
    assert message.usage.input_tokens == plain["usage"]["prompt_tokens"]
    assert message.usage.output_tokens == plain["usage"]["completion_tokens"]


def test_a_streamed_message_is_the_same_message(fleet):
    url, _ = fleet
    whole = create(url, system=[{"type": "text", "text": SYSTEM}], messages=ASK, max_tokens=24)
    with client(url).messages.stream(
        model=MODEL, max_tokens=24, system=SYSTEM, messages=ASK, extra_body={"seed": SEED}
    ) as stream:
        kinds = [event.type for event in stream if event.type not in ("text",)]
        streamed = stream.get_final_message()
    assert kinds[:2] == ["message_start", "content_block_start"] and kinds[-2:] == ["message_delta", "message_stop"]
    assert text_of(streamed) == text_of(whole) and text_of(whole)
    assert streamed.stop_reason == whole.stop_reason and streamed.usage == whole.usage
    assert streamed.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})


def test_a_stop_sequence_ends_the_message_and_is_named(fleet):
    url, _ = fleet
    text = text_of(create(url, messages=ASK, max_tokens=24))
    stop_at = text[6:9]
    cut = create(url, messages=ASK, max_tokens=24, stop_sequences=["never said", stop_at])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop_at
    assert text_of(cut) == text[: text.index(stop_at)]


def test_output_config_format_constrains_the_answer_to_its_schema(fleet):
    url, _ = fleet
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}, "sunny": {"type": "boolean"}},
        "required": ["city", "sunny"],
        "additionalProperties": False,
    }
    answer = create(
        url,
        messages=ASK,
        max_tokens=60,
        extra={"output_config": {"effort": "low", "format": {"type": "json_schema", "schema": schema}}},
    )
    parsed = json.loads(text_of(answer))
    assert set(parsed) == {"city", "sunny"} and isinstance(parsed["sunny"], bool)
    with pytest.raises(anthropic.BadRequestError) as refused:
        create(url, messages=ASK, extra={"output_config": {"format": {"type": "regex", "pattern": "a+"}}})
    assert "output_config.format" in refused.value.message


def test_tool_use_over_two_turns(fleet):
    url, _ = fleet
    ask = [{"role": "user", "content": "What time is it in Paris?"}]
    forced = {"type": "tool", "name": "get_time", "disable_parallel_tool_use": True}
    call = create(url, messages=ask, tools=[CLOCK], tool_choice=forced, max_tokens=200)
    assert call.stop_reason == "tool_use"
    [use] = [block for block in call.content if block.type == "tool_use"]
    assert use.name == "get_time" and use.input["zone"] in ("UTC", "CET") and use.id
    with client(url).messages.stream(
        model=MODEL, max_tokens=200, messages=ask, tools=[CLOCK], tool_choice=forced, extra_body={"seed": SEED}
    ) as stream:
        kinds = {event.delta.type for event in stream if event.type == "content_block_delta"}
        streamed = stream.get_final_message()
    assert "input_json_delta" in kinds and streamed.content == call.content
    answer = [{"type": "tool_result", "tool_use_id": use.id, "content": [{"type": "text", "text": "12:00"}]}]
    history = [*ask, {"role": "assistant", "content": call.content}, {"role": "user", "content": answer}]
    reply = create(url, messages=history, tools=[CLOCK], max_tokens=12)
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use") and reply.content
    failed = [{**answer[0], "is_error": True}]
    errored = [*ask, {"role": "assistant", "content": call.content}, {"role": "user", "content": failed}]
    counted = client(url).messages.count_tokens(model=MODEL, messages=errored, tools=[CLOCK])
    assert (
        counted.input_tokens
        > client(url).messages.count_tokens(model=MODEL, messages=history, tools=[CLOCK]).input_tokens
    )


def test_count_tokens_is_the_input_of_the_message(fleet):
    url, _ = fleet
    message = create(url, system=SYSTEM, messages=ASK, tools=[CLOCK])
    counted = client(url).messages.count_tokens(model=MODEL, system=SYSTEM, messages=ASK, tools=[CLOCK])
    assert counted.input_tokens == message.usage.input_tokens > 0


def test_refusals_are_in_anthropics_shape(fleet):
    url, _ = fleet
    bad_block = [{"role": "user", "content": [{"type": "bogus", "text": "hi"}]}]
    with pytest.raises(anthropic.BadRequestError) as refused:
        create(url, messages=bad_block)
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0].type" in refused.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="container"):
        create(url, {"container": "c1"}, messages=ASK)
    with pytest.raises(anthropic.AuthenticationError) as unknown_key:
        client(url, "wrong").messages.create(model=MODEL, max_tokens=4, messages=ASK)
    assert unknown_key.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError):
        client(url).messages.create(model="no-such-model", max_tokens=4, messages=ASK)
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client(url).post("/v1/messages", body={"model": MODEL, "messages": ASK}, cast_to=object)  # the SDK asks for it
