"""The Messages API's parts without a router: a request's translation into a chat completion
request, the chat stream's translation into Anthropic's events, the message object, errors and
the x-api-key credential."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.responses import Response

from shoal.protocol.sse import data_event
from shoal.router.admission.auth import authorization
from shoal.router.messages_api.errors import anthropic_shaped
from shoal.router.messages_api.event_stream import message_events
from shoal.router.messages_api.message_object import message_object
from shoal.router.messages_api.messages_request import MessagesRequest
from shoal.router.placement.route_request import RequestError
from shoal.router.streams.proxy import error_response

CLOCK = {"name": "get_time", "description": "The time", "input_schema": {"type": "object"}}


def parse(**fields) -> MessagesRequest:
    return MessagesRequest.parse({"model": "m", "max_tokens": 8, **fields})


def test_a_conversation_becomes_its_chat_messages_block_by_block():
    request = parse(
        system=[
            {"type": "text", "text": "Be "},
            {"type": "text", "text": "brief.", "cache_control": {"type": "ephemeral"}},
        ],
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "Time "}, {"type": "text", "text": "please"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "They want the time.", "signature": "sig"},
                    {"type": "text", "text": "Checking."},
                    {"type": "tool_use", "id": "call_1", "name": "get_time", "input": {"zone": "UTC"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "call_1", "content": "12:00"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "call_2",
                        "content": [{"type": "text", "text": "down"}],
                        "is_error": True,
                    },
                    {"type": "text", "text": "Thanks"},
                ],
            },
        ],
        tools=[CLOCK],
        tool_choice={"type": "any", "disable_parallel_tool_use": True},
        stop_sequences=["END"],
        temperature=0.5,
        top_k=40,
        metadata={"user_id": "u-1"},
        thinking={"type": "enabled", "budget_tokens": 1024},
        max_tokens=2000,
        stream=True,
        seed=3,
    )
    assert request.chat_body() == {
        "seed": 3,
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Time please"},
            {
                "role": "assistant",
                "content": "Checking.",
                "reasoning_content": "They want the time.",
                "tool_calls": [
                    {
                        "id": "call_1",
                        "type": "function",
                        "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "12:00"},
            {"role": "tool", "tool_call_id": "call_2", "content": "Error: down"},
            {"role": "user", "content": "Thanks"},
        ],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 2000,
        "temperature": 0.5,
        "top_k": 40,
        "stop": ["END"],
        "user": "u-1",
        "tools": [
            {
                "type": "function",
                "function": {"name": "get_time", "parameters": {"type": "object"}, "description": "The time"},
            }
        ],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "chat_template_kwargs": {"enable_thinking": True},
    }


@pytest.mark.parametrize(
    ("choice", "chat", "parallel"),
    [
        ({"type": "auto"}, "auto", None),
        ({"type": "none"}, "none", None),
        ({"type": "any"}, "required", None),
        ({"type": "tool", "name": "get_time"}, {"type": "function", "function": {"name": "get_time"}}, None),
        ({"type": "auto", "disable_parallel_tool_use": False}, "auto", True),
    ],
)
def test_tool_choices(choice, chat, parallel):
    request = parse(messages=[{"role": "user", "content": "hi"}], tools=[CLOCK], tool_choice=choice)
    assert (request.tool_choice, request.parallel_tool_calls) == (chat, parallel)


def test_thinking_prefill_tier_and_counting():
    ask = [{"role": "user", "content": "hi"}]
    assert parse(messages=ask, thinking={"type": "disabled"}).template_kwargs == {"enable_thinking": False}
    assert parse(messages=ask, thinking={"type": "adaptive"}).template_kwargs is None
    assert parse(messages=ask, service_tier="standard_only").chat_body()["service_tier"] == "default"
    prefilled = parse(messages=[*ask, {"role": "assistant", "content": "The answer is"}]).chat_body()
    assert prefilled["messages"][-1] == {"role": "assistant", "content": "The answer is"}
    assert prefilled["continue_final_message"] is True and prefilled["add_generation_prompt"] is False
    counting = MessagesRequest.parse({"model": "m", "messages": ask, "system": "s"}, counting=True)
    assert counting.count_body() == {
        "model": "m",
        "messages": [{"role": "system", "content": "s"}, *ask],
        "stream": False,
        "max_tokens": 1,
    }


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"container": "c"}, "container"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0].type"),
        (
            {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "x", "name": "n", "input": {}}]}]},
            "messages[0].content[0].type",
        ),
        (
            {"messages": [{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "x"}]}]},
            "messages[0].content[0].type",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "x", "content": [{"type": "image"}]}],
                    }
                ]
            },
            "messages[0].content[0].content[0].type",
        ),
        (
            {"messages": [{"role": "user", "content": [{"type": "text", "text": "a", "citations": [{}]}]}]},
            "messages[0].content[0].citations",
        ),
        ({"messages": [{"role": "system", "content": "a"}]}, "messages[0].role"),
        ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
        ({"tools": [CLOCK], "tool_choice": {"type": "tool", "name": "other"}}, "tool_choice.name"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
        ({"thinking": {"type": "enabled", "budget_tokens": 1024}}, "thinking.budget_tokens"),
        (
            {"thinking": {"type": "enabled", "budget_tokens": 1024, "display": "omitted"}, "max_tokens": 4096},
            "thinking.display",
        ),
        ({"temperature": 1.5}, "temperature"),
        ({"metadata": {"user_id": "u", "team": "t"}}, "metadata.team"),
        ({"max_tokens": None}, "max_tokens"),
        ({"stop_sequences": [""]}, "stop_sequences"),
    ],
)
def test_refusals_name_the_field(fields, param):
    with pytest.raises(RequestError) as refused:
        parse(**{"messages": [{"role": "user", "content": "hi"}], **fields})
    assert refused.value.param == param


def test_count_tokens_takes_no_sampling_fields():
    with pytest.raises(RequestError) as refused:
        MessagesRequest.parse({"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, True)
    assert refused.value.param == "max_tokens"


def events_of(chunks: list[dict | bytes]) -> list[tuple[str, dict]]:
    """(event name, data) of the Messages events for a chat stream of `chunks`."""

    async def chat():
        for chunk in chunks:
            yield chunk if isinstance(chunk, bytes) else data_event({"model": "served", **chunk})
        yield b"data: [DONE]\n\n"

    async def collect():
        return b"".join([event async for event in message_events(chat(), "msg_1", "asked")])

    out = []
    for raw in asyncio.run(collect()).decode().strip().split("\n\n"):
        name, data = raw.split("\n")
        assert name.startswith("event: ") and data.startswith("data: ")
        payload = json.loads(data[6:])
        assert payload["type"] == name[7:]
        out.append((name[7:], payload))
    return out


def delta(index: int = 0, finish: str | None = None, **fields) -> dict:
    return {"choices": [{"index": 0, "delta": fields, "finish_reason": finish}]}


def test_the_chat_stream_becomes_content_blocks_in_order():
    call = {"index": 0, "id": "call_9", "type": "function", "function": {"name": "get_time", "arguments": ""}}
    events = events_of(
        [
            delta(role="assistant", content=""),
            delta(reasoning_content="Hmm, "),
            delta(reasoning_content="time."),
            delta(content="Let me check."),
            delta(tool_calls=[call]),
            delta(tool_calls=[{"index": 0, "function": {"arguments": '{"zone": '}}]),
            delta(finish="tool_calls", tool_calls=[{"index": 0, "function": {"arguments": '"UTC"}'}}]),
            {"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": 7}},
        ]
    )
    assert [(name, data.get("index")) for name, data in events] == [
        ("message_start", None),
        ("ping", None),
        ("content_block_start", 0),
        ("content_block_delta", 0),
        ("content_block_delta", 0),
        ("content_block_stop", 0),
        ("content_block_start", 1),
        ("content_block_delta", 1),
        ("content_block_stop", 1),
        ("content_block_start", 2),
        ("content_block_delta", 2),
        ("content_block_delta", 2),
        ("content_block_stop", 2),
        ("message_delta", None),
        ("message_stop", None),
    ]
    start = events[0][1]["message"]
    assert start["id"] == "msg_1" and start["model"] == "served" and start["content"] == []
    assert [data["content_block"] for name, data in events if name == "content_block_start"] == [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": "call_9", "name": "get_time", "input": {}},
    ]
    deltas = [data["delta"] for name, data in events if name == "content_block_delta"]
    assert [d["type"] for d in deltas] == ["thinking_delta", "thinking_delta", "text_delta", *["input_json_delta"] * 2]
    assert "".join(d.get("partial_json", "") for d in deltas) == '{"zone": "UTC"}'
    assert events[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"input_tokens": 11, "output_tokens": 7},
    }


def test_stop_sequences_and_failures_in_the_stream():
    stopped = events_of(
        [delta(content="abc"), {"choices": [{"delta": {}, "finish_reason": "stop", "stop_reason": "END"}]}]
    )
    assert stopped[-2][1]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    failed = events_of([delta(content="abc"), {"error": {"message": "no worker left", "code": 503}}])
    assert failed[-1] == (
        "error",
        {"type": "error", "error": {"type": "overloaded_error", "message": "no worker left"}},
    )
    assert [name for name, _ in failed] == [
        "message_start",
        "ping",
        "content_block_start",
        "content_block_delta",
        "error",
    ]
    cut = events_of([delta(content="abc")])
    assert cut[-1][0] == "error" and "ended before" in cut[-1][1]["error"]["message"]


def test_a_completion_becomes_a_message():
    completion = {
        "model": "served",
        "usage": {"prompt_tokens": 5, "completion_tokens": 3},
        "choices": [
            {
                "finish_reason": "length",
                "message": {
                    "content": "ok",
                    "reasoning_content": "think",
                    "tool_calls": [{"id": "c1", "function": {"name": "f", "arguments": '{"a": '}}],
                },
            }
        ],
    }
    assert message_object("msg_2", completion) == {
        "id": "msg_2",
        "type": "message",
        "role": "assistant",
        "model": "served",
        "content": [
            {"type": "thinking", "thinking": "think", "signature": ""},
            {"type": "text", "text": "ok"},
            {"type": "tool_use", "id": "c1", "name": "f", "input": '{"a": '},
        ],
        "stop_reason": "max_tokens",
        "stop_sequence": None,
        "usage": {"input_tokens": 5, "output_tokens": 3},
    }


@pytest.mark.parametrize(
    ("status", "kind"),
    [
        (400, "invalid_request_error"),
        (401, "authentication_error"),
        (404, "not_found_error"),
        (413, "request_too_large"),
        (429, "rate_limit_error"),
        (503, "overloaded_error"),
        (500, "api_error"),
        (502, "api_error"),
    ],
)
def test_router_errors_in_anthropics_shape(status, kind):
    shaped = anthropic_shaped(error_response(status, "why", "whatever", headers={"retry-after": "2"}))
    assert shaped.status_code == status and shaped.headers["retry-after"] == "2"
    assert json.loads(shaped.body) == {"type": "error", "error": {"type": kind, "message": "why"}}
    assert isinstance(shaped, Response)


def test_the_key_may_come_as_x_api_key():
    assert authorization({"x-api-key": "k"}) == "Bearer k"
    assert authorization({"authorization": "Bearer a", "x-api-key": "k"}) == "Bearer a"
    assert authorization({}) is None
