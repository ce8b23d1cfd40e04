"""What holds for Llama holds for every family: a stream cut off mid-way and resumed on a fresh
engine from its token prefix (recomputing its KV, or importing it from the first engine) gives the
uninterrupted run's tokens and logprobs, greedy and seeded, past every sliding window; a
forced tool call ("required" or a named function), through the worker's chat endpoint with the
family's chat template (Gemma's turns, ChatML for Qwen3; the file's own where the family has none), is
one call whose arguments hold the tool's schema, with the same tokens alone and batched."""

from __future__ import annotations

import concurrent.futures
import json

import jsonschema
import pytest
from starlette.testclient import TestClient

from shoal.model.families import family_named, family_of_hf_model_type
from tests.support.engine_runs import assert_streams_resume_token_exact, engine_factory
from tests.support.family_variants import COMMON, FAMILIES, LAYER_VARIANTS
from tests.support.tiny_model import TINY_CHAT_TEMPLATE, write_random_family_model
from tests.support.tool_definitions import TIME, WEATHER

MODEL = "family"


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    """The family's random model with room for a tools prompt (one character a token), and without a
    chat template where its family has one of its own, so it chats with the family's."""
    config_class, model_class, fields = LAYER_VARIANTS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    fields = {**COMMON, **fields, "max_position_embeddings": 1536}
    reference = write_random_family_model(directory, config_class, model_class, fields)
    if family_of_hf_model_type(reference.config.model_type, str(directory)).chat_template is not None:
        settings = json.loads((directory / "tokenizer_config.json").read_text())
        del settings["chat_template"]
        (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    return directory


def test_each_familys_stream_resumes_token_exact_on_another_engine(family_model, shoal_cache_dir):
    make_engine = engine_factory(family_model, shoal_cache_dir, dtype="bfloat16", max_num_batched_tokens=32)
    assert_streams_resume_token_exact(make_engine)


TOOL_REQUESTS = {
    "required": {"tool_choice": "required", "seed": 3, "messages": [{"role": "user", "content": "Weather in Paris?"}]},
    "named": {
        "tool_choice": {"type": "function", "function": {"name": "get_time"}},
        "seed": 4,
        "messages": [{"role": "user", "content": "Time in Tokyo?"}],
    },
}
# Beside them: free text, and output held to a schema of its own (another grammar in the batch).
NEIGHBOURS = {
    "free": {"seed": 7, "max_tokens": 24, "ignore_eos": True, "messages": [{"role": "user", "content": "Hello"}]},
    "json": {
        "seed": 8,
        "messages": [{"role": "user", "content": "Weather?"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "w", "schema": WEATHER["function"]["parameters"]},
        },
    },
}


@pytest.fixture
def worker(family_model, shoal_cache_dir):
    """A client of the worker's app, in this process, serving the family's model."""
    from shoal.engine.async_engine import AsyncLLMEngine
    from shoal.worker.server import create_app

    engine = AsyncLLMEngine(engine_factory(family_model, shoal_cache_dir, dtype="bfloat16"))
    try:
        with TestClient(create_app(engine, MODEL)) as client:
            yield client, engine.engine
    finally:
        engine.shutdown()


def chat(client, fields: dict) -> dict:
    body = {"model": MODEL, "temperature": 1.0, "max_tokens": 120, **fields}
    if "tool_choice" in fields:
        body.update(tools=[WEATHER, TIME], parallel_tool_calls=False)
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_each_familys_forced_tool_call_holds_its_schema_alone_and_batched(worker):
    client, engine = worker
    template = family_named(engine.checkpoint.config.architecture).chat_template
    assert engine.tokenizer.chat_template == (template or TINY_CHAT_TEMPLATE)
    alone = {name: chat(client, fields) for name, fields in TOOL_REQUESTS.items()}
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
    for choice in alone.values():
        assert choice["finish_reason"] == "tool_calls", choice
        [call] = choice["message"]["tool_calls"]
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    assert alone["named"]["message"]["tool_calls"][0]["function"]["name"] == "get_time"
    requests = {**TOOL_REQUESTS, **NEIGHBOURS}
    with concurrent.futures.ThreadPoolExecutor(len(requests)) as pool:
        futures = {name: pool.submit(chat, client, fields) for name, fields in requests.items()}
        batched = {name: future.result() for name, future in futures.items()}
    for name, choice in alone.items():
        assert batched[name]["token_ids"] == choice["token_ids"]
        assert batched[name]["message"] == choice["message"]
