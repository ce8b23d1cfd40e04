"""Nothing a client sends is dropped silently: every field of the official SDKs' request types
(openai's chat, completions, embeddings and responses; anthropic's messages and count_tokens) is
either served, and a request carrying it with a sample value is taken, or refused, and a request
carrying it is a 400 naming it. A field a new SDK adds fails here until it is given one or the other."""

from __future__ import annotations

import anthropic.types.message_count_tokens_params as anthropic_count
import anthropic.types.message_create_params as anthropic_messages
import openai.types.chat.completion_create_params as openai_chat
import openai.types.completion_create_params as openai_completions
import openai.types.embedding_create_params as openai_embeddings
import openai.types.responses.response_create_params as openai_responses
import pydantic
import pytest

from shoal.router.messages_api.messages_request import MessagesRequest
from shoal.router.placement.route_request import RequestError
from shoal.router.responses_api.responses_request import ResponsesRequest
from shoal.worker.embeddings import EmbeddingRequest
from shoal.worker.protocol import ChatCompletionRequest, CompletionRequest

USER = [{"role": "user", "content": "hi"}]
WEATHER = {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
# A served field's sample value; a refused field is sent as {} (any value is refused by name).
CHAT = {
    "messages": USER,
    "model": "m",
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "function_call": "auto",
    "functions": [WEATHER],
    "logit_bias": {"5": -100},
    "logprobs": True,
    "top_logprobs": 2,
    "max_completion_tokens": 8,
    "max_tokens": 8,
    "metadata": {"k": "v"},
    "modalities": ["text"],
    "n": 2,
    "parallel_tool_calls": False,
    "prediction": {"type": "content", "content": "draft"},
    "prompt_cache_key": "agent-7",
    "reasoning_effort": "low",
    "response_format": {"type": "json_object"},
    "safety_identifier": "u1",
    "seed": 3,
    "service_tier": "flex",
    "stop": ["\n"],
    "store": False,
    "stream_options": {"include_usage": True},
    "temperature": 0.5,
    "tool_choice": "auto",
    "tools": [{"type": "function", "function": WEATHER}],
    "top_p": 0.9,
    "user": "u",
    "verbosity": "low",
}
CHAT_REFUSED = {"audio", "web_search_options", "moderation", "prompt_cache_options", "prompt_cache_retention"}
COMPLETIONS = {
    "model": "m",
    "prompt": "hi",
    "echo": False,
    "frequency_penalty": 0.5,
    "presence_penalty": 0.5,
    "logit_bias": {"5": 1},
    "logprobs": 2,
    "max_tokens": 8,
    "n": 2,
    "seed": 3,
    "stop": "x",
    "stream_options": {"include_usage": True},
    "temperature": 0.5,
    "top_p": 0.9,
    "user": "u",
}
COMPLETIONS_REFUSED = {"best_of", "suffix"}
EMBEDDINGS = {"model": "m", "input": "hi", "dimensions": 8, "encoding_format": "base64", "user": "u"}
RESPONSES = {
    "model": "m",
    "input": "hi",
    "include": ["message.output_text.logprobs"],
    "instructions": "be brief",
    "max_output_tokens": 8,
    "max_tool_calls": 2,
    "metadata": {"k": "v"},
    "parallel_tool_calls": False,
    "previous_response_id": "resp_1",
    "prompt_cache_key": "agent-7",
    "reasoning": {"effort": "low"},
    "safety_identifier": "u1",
    "service_tier": "priority",
    "store": False,
    "temperature": 0.5,
    "text": {"format": {"type": "text"}, "verbosity": "low"},
    "tool_choice": "auto",
    "tools": [{"type": "function", **WEATHER}],
    "top_logprobs": 2,
    "top_p": 0.9,
    "truncation": "auto",
    "user": "u",
    "background": False,
}
RESPONSES_REFUSED = {
    "access_programs",
    "background_options",
    "context_management",
    "conversation",
    "image",
    "moderation",
    "prompt",
    "prompt_cache_options",
    "prompt_cache_retention",
    "stream_options",
}
MESSAGES = {
    "model": "m",
    "max_tokens": 8,
    "messages": USER,
    "system": "be brief",
    "metadata": {"user_id": "u"},
    "stop_sequences": ["\n"],
    "thinking": {"type": "disabled"},
    "tool_choice": {"type": "auto"},
    "tools": [{"name": "get_weather", "input_schema": WEATHER["parameters"]}],
    "service_tier": "auto",
    "cache_control": {"type": "ephemeral"},
    "output_config": {"effort": "low", "format": {"type": "json_schema", "schema": WEATHER["parameters"]}},
}
MESSAGES_REFUSED = {
    "container",
    "diagnostics",
    "inference_geo",
    "speed",
    "user_profile_id",
    "workspace_id",
}


def fields(params: type) -> set[str]:
    """A TypedDict's keys, its bases' included."""
    return {name for cls in params.__mro__ for name in getattr(cls, "__annotations__", {})}


def pydantic_refusal(model: type[pydantic.BaseModel], body: dict) -> str | None:
    """The field a worker's 400 names (pydantic's first error location), or None when taken."""
    try:
        model.model_validate(body)
    except pydantic.ValidationError as error:
        return str(error.errors()[0]["loc"][0]) if error.errors()[0]["loc"] else "body"
    return None


def router_refusal(parse, body: dict) -> str | None:
    try:
        parse(body)
    except RequestError as error:
        return error.param or "body"
    return None


# What a served field needs beside it to be taken, by API.
NEEDS = {
    "chat": {"function_call": {"functions": [WEATHER]}, "tool_choice": {"tools": CHAT["tools"]}},
    "responses": {"tool_choice": {"tools": RESPONSES["tools"]}},
    "messages": {"tool_choice": {"tools": MESSAGES["tools"]}},
}
CASES = [
    ("chat", openai_chat.CompletionCreateParamsBase, CHAT, CHAT_REFUSED, ChatCompletionRequest, pydantic_refusal),
    (
        "completions",
        openai_completions.CompletionCreateParamsBase,
        COMPLETIONS,
        COMPLETIONS_REFUSED,
        CompletionRequest,
        pydantic_refusal,
    ),
    ("embeddings", openai_embeddings.EmbeddingCreateParams, EMBEDDINGS, set(), EmbeddingRequest, pydantic_refusal),
    (
        "responses",
        openai_responses.ResponseCreateParamsBase,
        RESPONSES,
        RESPONSES_REFUSED,
        ResponsesRequest.parse,
        router_refusal,
    ),
    (
        "messages",
        anthropic_messages.MessageCreateParamsBase,
        MESSAGES,
        MESSAGES_REFUSED,
        MessagesRequest.parse,
        router_refusal,
    ),
]


@pytest.mark.parametrize(("name", "params", "served", "refused", "parser", "refusal"), CASES, ids=[c[0] for c in CASES])
def test_every_sdk_field_is_served_or_refused_by_name(name, params, served, refused, parser, refusal):
    assert fields(params) <= set(served) | refused, sorted(fields(params) - set(served) - refused)
    required = {key: served[key] for key in ("model", "messages", "input", "prompt", "max_tokens") if key in served}
    for field, value in served.items():  # each with its sample value (and what it needs beside it)
        body = {**required, **NEEDS.get(name, {}).get(field, {}), field: value}
        assert refusal(parser, body) is None, field
    for field in refused:
        assert refusal(parser, {**required, field: {}}) == field, field


def test_count_tokens_takes_the_messages_fields_that_shape_the_prompt():
    count = {key: value for key, value in MESSAGES.items() if key in fields(anthropic_count.MessageCountTokensParams)}
    assert router_refusal(lambda body: MessagesRequest.parse(body, counting=True), count) is None
    assert fields(anthropic_count.MessageCountTokensParams) <= set(MESSAGES) | MESSAGES_REFUSED
