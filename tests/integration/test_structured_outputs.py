"""Structured output and tool calls with the official openai client, through a real router in front
of a real worker: outputs match their schemas at temperature 1, tools are called as asked
(required, named, auto, none), streamed calls add up to the non-streamed ones, tool results feed the
next turn, constrained sampling is batch-invariant, and bad constraints are 400s that leave the
workers serving."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import jsonschema
import openai
import pytest
import yaml
from pydantic import BaseModel

from tests.support.routers import start_router, stop
from tests.support.tool_definitions import TIME, WEATHER
from tests.support.workers import MODEL, spawn_worker, tiny_worker_args, wait_ready

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Person(BaseModel):
    name: str
    age: int
    member: bool


def router_config(directory, workers: list[str], redis_url: str):
    """A router over `workers` that keeps stored responses in Redis (shared by every such router)."""
    config = directory / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {"workers": [{"url": url} for url in workers], "state": {"store": "redis", "redis_url": redis_url}}
        )
    )
    return ["--config", str(config)]


@pytest.fixture(scope="module")
def fleet(long_tiny_model_dir, shoal_cache_dir, redis_url, tmp_path_factory):
    """(router url, [worker url]): a worker of the tiny model with a long context behind a router."""
    spawned = [spawn_worker(tiny_worker_args(long_tiny_model_dir, MODEL), shoal_cache_dir)]
    workers = [worker_url for _, worker_url in (wait_ready(*worker) for worker in spawned)]
    router, url = start_router(router_config(tmp_path_factory.mktemp("structured"), workers, redis_url))
    yield url, workers
    stop(router)
    for process, _ in spawned:
        stop(process)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_json_schema_output_validates_for_seeded_samples_at_temperature_one(fleet):
    url, _ = fleet
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def sample(seed: int) -> str:
        reply = client(url).chat.completions.create(
            model=MODEL, messages=ASK, response_format=response_format, temperature=1.0, seed=seed, max_tokens=400
        )
        assert reply.choices[0].finish_reason == "stop"
        return reply.choices[0].message.content

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outputs = list(pool.map(sample, range(20)))
    for output in outputs:
        jsonschema.validate(json.loads(output), PERSON)
    assert len(set(outputs)) > 10  # sampled, not one greedy answer


def test_a_schema_that_is_not_strict_ends_with_its_own_properties(fleet):
    """instructor's JSON_SCHEMA mode: no additionalProperties, no strict; the output still ends."""
    url, _ = fleet
    loose = {key: value for key, value in PERSON.items() if key != "additionalProperties"}
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": loose}}
    for seed in range(4):
        reply = client(url).chat.completions.create(
            model=MODEL, messages=ASK, response_format=response_format, temperature=1.0, seed=seed, max_tokens=400
        )
        assert reply.choices[0].finish_reason == "stop"
        assert set(json.loads(reply.choices[0].message.content)) == set(PERSON["properties"])


def test_parse_with_a_pydantic_model_and_json_object(fleet):
    url, _ = fleet
    parsed = client(url).chat.completions.parse(
        model=MODEL, messages=ASK, response_format=Person, seed=3, max_tokens=1500
    )
    assert isinstance(parsed.choices[0].message.parsed, Person)
    free = client(url).chat.completions.create(
        model=MODEL, messages=ASK, response_format={"type": "json_object"}, seed=4, max_tokens=1500
    )
    assert free.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(free.choices[0].message.content), dict)


@pytest.mark.parametrize(
    ("constraint", "check"),
    [
        ({"regex": r"[A-Z][a-z]{2,5}-[0-9]{3}"}, lambda text: len(text.split("-")[1]) == 3 and text[0].isupper()),
        ({"choice": ["sunny", "rainy", "foggy and cold"]}, lambda text: text in ("sunny", "rainy", "foggy and cold")),
        ({"grammar": 'root ::= "(" [0-9]+ ("+" [0-9]+)* ")"'}, lambda text: text[0] == "(" and text[-1] == ")"),
        ({"grammar": 'start: "yes" | "no"'}, lambda text: text in ("yes", "no")),
    ],
)
def test_regex_choice_and_grammars(fleet, constraint, check):
    url, _ = fleet
    for seed in range(3):
        reply = client(url).chat.completions.create(
            model=MODEL, messages=ASK, seed=seed, max_tokens=60, extra_body={"structured_outputs": constraint}
        )
        text = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop" and check(text), text


def test_required_and_named_tool_calls_match_their_schemas(fleet):
    """With one call allowed, `required` always ends in a call that matches its schema. With
    parallel calls, the grammar allows any number, and a random model may go on calling until
    max_tokens: every call it finished matches its schema."""
    url, _ = fleet
    finished = 0
    for seed in range(4):
        for parallel in (False, True):
            reply = client(url).chat.completions.create(
                model=MODEL,
                messages=ASK,
                tools=[WEATHER, TIME],
                tool_choice="required",
                parallel_tool_calls=parallel,
                seed=seed,
                max_tokens=400,
            )
            choice = reply.choices[0]
            calls = choice.message.tool_calls or []
            if not parallel:
                assert choice.finish_reason == "tool_calls" and len(calls) == 1, (seed, choice)
            finished += choice.finish_reason == "tool_calls"
            complete = calls if choice.finish_reason == "tool_calls" else calls[:-1]  # the last may be cut
            for call in complete:
                schema = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]["function"]["parameters"]
                jsonschema.validate(json.loads(call.function.arguments), schema)
                assert call.id.startswith("call_") and call.type == "function"
    assert finished > 4  # every single call, and some of the parallel ones
    named = client(url).chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
        parallel_tool_calls=False,
        seed=5,
        max_tokens=400,
    )
    [call] = named.choices[0].message.tool_calls
    assert call.function.name == "get_time" and json.loads(call.function.arguments)["zone"] in ("UTC", "CET")


def test_legacy_functions_are_served_as_tools_in_the_legacy_shape(fleet):
    """functions + function_call: one call, as message.function_call, finish reason
    "function_call", streamed as a name then argument fragments (through the router both ways);
    the call and its `function` result in the history carry the conversation on."""
    url, _ = fleet
    functions = [WEATHER["function"], TIME["function"]]
    args = dict(model=MODEL, messages=ASK, functions=functions, function_call={"name": "get_weather"}, seed=3)
    reply = client(url).chat.completions.create(**args, max_tokens=300)
    choice = reply.choices[0]
    assert choice.finish_reason == "function_call" and choice.message.tool_calls is None
    call = choice.message.function_call
    assert call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    chunks = list(client(url).chat.completions.create(**args, max_tokens=300, stream=True))
    deltas = [c.choices[0].delta.function_call for c in chunks if c.choices and c.choices[0].delta.function_call]
    assert deltas[0].name == "get_weather" and "".join(d.arguments or "" for d in deltas) == call.arguments
    history = [
        *ASK,
        {"role": "assistant", "content": None, "function_call": {"name": call.name, "arguments": call.arguments}},
        {"role": "function", "name": "get_weather", "content": '{"temperature": 21}'},
    ]
    after = client(url).chat.completions.create(model=MODEL, messages=history, functions=functions, max_tokens=8)
    assert after.choices[0].finish_reason in ("stop", "length", "function_call")
    orphan = httpx.post(
        url + "/v1/chat/completions",
        json={"model": MODEL, "messages": [*ASK, history[2]], "max_tokens": 4},
        timeout=60,
    )
    assert orphan.status_code == 400 and "answers no function_call" in orphan.text


def test_auto_reads_calls_the_model_writes_and_none_leaves_tools_out(fleet):
    url, _ = fleet
    written = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
    # The output is pinned to a call written out in full: `auto` must read it as a tool call.
    pinned = {"structured_outputs": {"choice": [f"Checking.\n{written}"]}}
    reply = client(url).chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="auto", max_tokens=200, extra_body=pinned
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris", "days": 2}
    untouched = client(url).chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=200, extra_body=pinned
    )
    assert untouched.choices[0].message.tool_calls is None
    assert untouched.choices[0].message.content == f"Checking.\n{written}"
    # Auto with plain prose is content.
    prose = client(url).chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": "[a-z ]{5,20}"}},
    )
    assert prose.choices[0].message.tool_calls is None and prose.choices[0].finish_reason == "stop"


def test_streamed_tool_calls_add_up_to_the_non_streamed_ones(fleet):
    url, _ = fleet
    # Parallel calls: after each call the model may start another or stop; the room is ample.
    request = {"model": MODEL, "messages": ASK, "tools": [TIME], "tool_choice": "required", "max_tokens": 1500}
    for seed in (12,):
        whole = client(url).chat.completions.create(**request, seed=seed)
        calls: dict[int, dict] = {}
        finish, names_first = None, True
        for chunk in client(url).chat.completions.create(**request, seed=seed, stream=True):
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
                for delta in choice.delta.tool_calls or []:
                    call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                    if delta.id:
                        assert call["id"] is None  # one id per call, sent once
                        call["id"], call["name"] = delta.id, delta.function.name
                    names_first = names_first and call["name"] is not None
                    call["arguments"] += delta.function.arguments or ""
        expected = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in whole.choices[0].message.tool_calls
        ]
        assert [calls[i] for i in sorted(calls)] == expected and names_first
        assert finish == whole.choices[0].finish_reason == "tool_calls"


def test_a_tool_result_turn_continues_the_conversation(fleet):
    url, _ = fleet
    first = client(url).chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required", seed=2, max_tokens=300
    )
    message = first.choices[0].message
    history = [
        *ASK,
        message.model_dump(exclude_none=True),
        *[
            {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"forecast": "sun", "celsius": 21})}
            for call in message.tool_calls
        ],
    ]
    answer = client(url).chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], seed=2, max_tokens=12)
    assert answer.choices[0].finish_reason == "length"
    # The whole history reached the prompt: the tool result and the call are in it.
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + len(message.tool_calls[0].function.arguments)


def test_constrained_sampling_is_the_same_alone_and_in_a_mixed_batch(fleet):
    _, workers = fleet
    worker = workers[0]
    constrained = {
        "model": MODEL,
        "messages": ASK,
        "temperature": 1.0,
        "seed": 99,
        "max_tokens": 300,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    }
    alone = httpx.post(worker + "/v1/chat/completions", json=constrained, timeout=120).json()

    def mixed(i: int) -> dict:
        if i % 3 == 0:
            return {**constrained, "seed": i}
        if i % 3 == 1:
            return {"model": MODEL, "messages": ASK, "seed": i, "max_tokens": 40 + i, "ignore_eos": True}
        return {
            "model": MODEL,
            "messages": ASK,
            "seed": i,
            "max_tokens": 300,
            "tools": [WEATHER],
            "tool_choice": "required",
        }

    others = [mixed(i) for i in range(15)]
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(httpx.post, worker + "/v1/chat/completions", json=body, timeout=120) for body in others]
        batched = pool.submit(httpx.post, worker + "/v1/chat/completions", json=constrained, timeout=120).result()
        assert all(f.result().status_code == 200 for f in futures)
    assert batched.json()["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    jsonschema.validate(json.loads(alone["choices"][0]["message"]["content"]), PERSON)


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}},
                }
            },
            "uniqueItems",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}},
            "strnig",
        ),
        ({"structured_outputs": {"regex": "([a-z"}}, "unclosed"),
        ({"structured_outputs": {"grammar": "root ::= ("}}, "grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "exactly one"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tool_choice": "required"}, "tools"),
        ({"logit_bias": {"5": 1000}}, "logit_bias"),
    ],
)
def test_bad_constraints_are_400s_naming_the_problem(fleet, extra, named):
    url, workers = fleet
    body = {"model": MODEL, "messages": ASK, "max_tokens": 4, **extra}
    refused = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400 and named in refused.json()["error"]["message"], refused.text
    for worker in workers:
        served = httpx.post(worker + "/v1/chat/completions", json={"model": MODEL, "messages": ASK, "max_tokens": 2})
        assert served.status_code == 200


@pytest.fixture(scope="module")
def two_routers(fleet, redis_url, tmp_path_factory):
    """The fleet's router and a second one in front of the same workers, sharing stored responses."""
    url, workers = fleet
    process, second = start_router(router_config(tmp_path_factory.mktemp("second-router"), workers, redis_url))
    yield [url, second]
    stop(process)


FLAT_WEATHER = {"type": "function", **WEATHER["function"]}


def test_responses_text_format_follows_its_schema(two_routers):
    url = two_routers[0]
    reply = client(url).responses.create(
        model=MODEL,
        input="Describe a person.",
        text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}},
        max_output_tokens=400,
        temperature=1.0,
        extra_body={"seed": 8},
    )
    assert reply.status == "completed"
    jsonschema.validate(json.loads(reply.output_text), PERSON)
    parsed = client(url).responses.parse(
        model=MODEL, input="A member?", text_format=Person, max_output_tokens=1500, extra_body={"seed": 9}
    )
    assert isinstance(parsed.output_parsed, Person)


def test_a_function_tool_loop_runs_over_two_turns_across_routers(two_routers):
    first_router, second_router = two_routers
    streamed = client(first_router).responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[FLAT_WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        max_output_tokens=300,
        stream=True,
        extra_body={"seed": 3},
    )
    events = list(streamed)
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    first = events[-1].response
    [call] = first.output
    fragments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert call.type == "function_call" and call.name == "get_weather" and fragments == call.arguments
    jsonschema.validate(json.loads(call.arguments), WEATHER["function"]["parameters"])
    # The result goes back to the other router, which continues the stored chain.
    second = client(second_router).responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": '{"forecast": "sun"}'}],
        tools=[FLAT_WEATHER],
        max_output_tokens=8,
        extra_body={"seed": 3},
    )
    assert second.status == "incomplete" and second.output[0].type == "message"
    # The whole loop reached the model: the first prompt, the call and its output.
    assert second.usage.input_tokens > first.usage.input_tokens + len(call.arguments) + len('{"forecast": "sun"}')


def test_completions_and_several_choices_are_constrained_too(fleet):
    url, _ = fleet
    completion = client(url).completions.create(
        model=MODEL,
        prompt="Pick one:",
        max_tokens=20,
        seed=1,
        extra_body={"structured_outputs": {"choice": ["red", "blue"]}},
    )
    assert completion.choices[0].text in ("red", "blue") and completion.choices[0].finish_reason == "stop"
    several = client(url).chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        n=3,
        seed=4,
        max_tokens=300,
    )
    calls = [choice.message.tool_calls[0] for choice in several.choices]
    assert len({call.id for call in calls}) == 3  # each choice its own call ids
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])


def test_a_grammar_no_token_can_follow_is_a_400_not_a_failure_of_the_worker(fleet):
    """The tiny model's tokens spell printable characters only: this choice dead-ends after "a"."""
    url, workers = fleet
    body = {"model": MODEL, "messages": ASK, "max_tokens": 8, "structured_outputs": {"choice": ["a\x1f"]}}
    refused = httpx.post(workers[0] + "/v1/chat/completions", json=body, timeout=60)
    assert refused.status_code == 400 and "allows no token" in refused.json()["error"]["message"]
    assert refused.json()["error"]["param"] == "structured_outputs"
    streamed = httpx.post(url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    assert "allows no token" in streamed.text  # an error event ends the stream
    assert httpx.post(url + "/v1/chat/completions", json=body, timeout=60).status_code == 400  # not retried
    assert httpx.post(workers[0] + "/v1/chat/completions", json={**body, "structured_outputs": None}).status_code == 200
