"""The Responses API's pure parts: request validation, input items to chat messages, pages of
input items, and the event stream, checked against the official openai types."""

from __future__ import annotations

import asyncio
import json

import pydantic
import pytest
from openai.types.responses import Response, ResponseItem, ResponseStreamEvent

from shoal.router.list_pages import PageQuery
from shoal.router.placement.route_request import RequestError
from shoal.router.responses_api.event_stream import response_events
from shoal.router.responses_api.input_items import (
    conversation_messages,
    normalize_input,
)
from shoal.router.responses_api.response_object import (
    assistant_output,
    finished_response,
    response_skeleton,
    responses_usage,
)
from shoal.router.responses_api.responses_request import ResponsesRequest
from shoal.router.responses_api.stored_turn import StoredTurn
from shoal.router.state.records import StoreUnavailable

ITEMS = pydantic.TypeAdapter(list[ResponseItem])
EVENT = pydantic.TypeAdapter(ResponseStreamEvent)


def parse(**fields) -> ResponsesRequest:
    return ResponsesRequest.parse({"model": "tiny", "input": "hi", **fields})


def test_a_string_input_is_one_user_message():
    [item] = normalize_input("hello")
    assert item["id"].startswith("msg_") and item["role"] == "user" and item["status"] == "completed"
    assert item["content"] == [{"type": "input_text", "text": "hello"}]
    ITEMS.validate_python([item])


def test_message_items_are_normalised_with_text_parts_by_role():
    items = normalize_input(
        [
            {"role": "developer", "content": "be brief"},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}],
            },
            {"role": "assistant", "content": [{"type": "output_text", "text": "c", "annotations": []}]},
        ]
    )
    assert [i["role"] for i in items] == ["developer", "user", "assistant"]
    assert items[2]["content"] == [{"type": "output_text", "text": "c", "annotations": []}]
    assert len({i["id"] for i in items}) == 3
    ITEMS.validate_python(items)


@pytest.mark.parametrize(
    "raw,param",
    [
        (None, "input"),
        ("", "input"),
        ([], "input"),
        ({"role": "user", "content": "x"}, "input"),
        (["text"], "input[0]"),
        ([{"role": "user", "content": "ok"}, {"role": "robot", "content": "x"}], "input[1].role"),
        ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input[0].call_id"),
        ([{"type": "computer_call"}], "input[0].type"),
        ([{"role": "user"}], "input[0].content"),
        ([{"role": "user", "content": []}], "input[0].content"),
        ([{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}], "input[0].content[0].type"),
        ([{"role": "user", "content": ["plain"]}], "input[0].content[0].type"),
        ([{"role": "user", "content": [{"type": "input_text", "text": 3}]}], "input[0].content[0].text"),
    ],
)
def test_bad_input_names_the_field(raw, param):
    with pytest.raises(RequestError) as refused:
        normalize_input(raw)
    assert refused.value.param == param and str(refused.value)


def test_the_conversation_is_instructions_then_every_turn_then_the_new_input():
    def stored(user: str, reply: str, previous: str | None) -> StoredTurn:
        request = parse(instructions=f"old {user}", previous_response_id=previous)
        skeleton = response_skeleton(f"resp_{user}", request, 0)
        output = assistant_output("msg_x", {"content": reply}, "completed")
        return StoredTurn(finished_response(skeleton, output, "stop", None, None), normalize_input(user), "me")

    chain = [stored("one", "1", None), stored("two", "2", "resp_one")]
    messages = conversation_messages("new rules", chain, normalize_input([{"role": "user", "content": "three"}]))
    assert messages == [
        {"role": "system", "content": "new rules"},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "1"},
        {"role": "user", "content": "two"},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "three"},
    ]
    assert conversation_messages(None, [], normalize_input("x")) == [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    "body,param",
    [
        ([1], None),
        ({"input": "x"}, "model"),
        ({"model": 3, "input": "x"}, "model"),
        ({"model": "m", "input": "x", "temperature": 3}, "temperature"),
        ({"model": "m", "input": "x", "temperature": "hot"}, "temperature"),
        ({"model": "m", "input": "x", "top_p": 0}, "top_p"),
        ({"model": "m", "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": "m", "input": "x", "max_output_tokens": True}, "max_output_tokens"),
        ({"model": "m", "input": "x", "max_output_tokens": 1.5}, "max_output_tokens"),
        ({"model": "m", "input": "x", "store": "yes"}, "store"),
        ({"model": "m", "input": "x", "stream": 1}, "stream"),
        ({"model": "m", "input": "x", "instructions": 5}, "instructions"),
        ({"model": "m", "input": "x", "previous_response_id": 7}, "previous_response_id"),
        ({"model": "m", "input": "x", "metadata": {"k": 1}}, "metadata"),
        ({"model": "m", "input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"model": "m", "input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"model": "m", "input": "x", "tools": [{"type": "function", "name": "f", "x": 1}]}, "tools[0].x"),
        ({"model": "m", "input": "x", "tools": [{"type": "function", "name": ""}]}, "tools[0].name"),
        ({"model": "m", "input": "x", "tool_choice": "sometimes"}, "tool_choice"),
        ({"model": "m", "input": "x", "tool_choice": {"type": "function", "name": "f"}}, "tool_choice"),
        ({"model": "m", "input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"model": "m", "input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format"),
        ({"model": "m", "input": "x", "text": {"verbosity": "terse"}}, "text.verbosity"),
        ({"model": "m", "input": "x", "text": {"stop": "x"}}, "text"),
        ({"model": "m", "input": "x", "include": ["reasoning.encrypted_content"]}, "include"),
        ({"model": "m", "input": "x", "include": "all"}, "include"),
        ({"model": "m", "input": "x", "truncation": "middle"}, "truncation"),
        ({"model": "m", "input": "x", "service_tier": "scale"}, "service_tier"),
        ({"model": "m", "input": "x", "prompt_cache_key": 3}, "prompt_cache_key"),
        ({"model": "m", "input": "x", "background": True, "store": False}, "background"),
        ({"model": "m", "input": "x", "max_tool_calls": -1}, "max_tool_calls"),
        ({"model": "m", "input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input[0].arguments"),
        ({"model": "m", "input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        ({"model": "m", "input": [{"type": "reasoning"}]}, "input[0].summary"),
        ({"model": "m", "input": "x", "reasoning": "low"}, "reasoning"),
        ({"model": "m", "input": "x", "reasoning": {"effort": "extreme"}}, "reasoning.effort"),
        ({"model": "m", "input": "x", "reasoning": {"effort": "low", "summary": "auto"}}, "reasoning.summary"),
        ({"model": "m", "input": "x", "frobnicate": True}, "frobnicate"),
        ({"model": "m"}, "input"),
    ],
)
def test_bad_requests_name_the_field(body, param):
    with pytest.raises(RequestError) as refused:
        ResponsesRequest.parse(body)
    assert refused.value.param == param


def test_the_chat_body_carries_only_what_was_given():
    plain = parse().chat_body([{"role": "user", "content": "hi"}])
    assert plain == {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "stream": False}
    full = parse(
        max_output_tokens=9,
        temperature=0.5,
        top_p=0.9,
        seed=4,
        ignore_eos=True,
        user="u",
        stream=True,
        tools=[],
        tool_choice="auto",
        text={"format": {"type": "text"}},
        metadata={"k": "v"},
        reasoning={"effort": "low", "summary": None},
        include=[],
        truncation="disabled",
        background=False,
        max_tool_calls=3,
        service_tier="flex",
        prompt_cache_key="agent-7",
        safety_identifier="end-user-1",
    ).chat_body([])
    assert full == {
        "model": "tiny",
        "messages": [],
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_tokens": 9,
        "temperature": 0.5,
        "top_p": 0.9,
        "seed": 4,
        "ignore_eos": True,
        "user": "u",
        "reasoning_effort": "low",
        "service_tier": "flex",
        "prompt_cache_key": "agent-7",
        "safety_identifier": "end-user-1",
    }
    verbose = parse(text={"format": {"type": "text"}, "verbosity": "high"})
    assert verbose.chat_body([])["verbosity"] == "high"
    assert response_skeleton("resp_1", verbose, 1)["text"]["verbosity"] == "high"


def test_response_objects_validate_as_the_official_type():
    request = parse(
        instructions="sys", metadata={"k": "v"}, max_output_tokens=5, service_tier="priority", max_tool_calls=2
    )
    skeleton = response_skeleton("resp_1", request, 123)
    assert Response.model_validate(skeleton).service_tier == "priority" and skeleton["max_tool_calls"] == 2
    output = assistant_output("msg_1", {"content": "out"}, "incomplete")
    done = finished_response(skeleton, output, "length", {"prompt_tokens": 7, "completion_tokens": 5}, "tiny")
    parsed = Response.model_validate(done)
    assert parsed.output_text == "out" and parsed.status == "incomplete"
    assert parsed.incomplete_details.reason == "max_output_tokens"
    assert (parsed.usage.input_tokens, parsed.usage.output_tokens, parsed.usage.total_tokens) == (7, 5, 12)
    empty = assistant_output("m", {"content": ""}, "completed")
    assert Response.model_validate(finished_response(skeleton, empty, "stop", None, None)).status == "completed"
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    called = Response.model_validate(
        finished_response(
            skeleton,
            assistant_output("m", {"content": None, "tool_calls": [call]}, "completed"),
            "tool_calls",
            None,
            None,
        )
    )
    [item] = called.output
    assert item.type == "function_call" and item.call_id == "call_1" and item.arguments == '{"a": 1}'


def test_tools_and_text_formats_become_the_chat_request():
    tool = {"type": "function", "name": "f", "description": "d", "parameters": {"type": "object"}}
    body = parse(tools=[tool], tool_choice={"type": "function", "name": "f"}, parallel_tool_calls=False).chat_body([])
    assert body["tools"] == [
        {"type": "function", "function": {"name": "f", "description": "d", "parameters": {"type": "object"}}}
    ]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "f"}}
    assert body["parallel_tool_calls"] is False
    schema = {"type": "json_schema", "name": "n", "schema": {"type": "object"}, "strict": True}
    assert parse(text={"format": schema}).chat_body([])["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": {"type": "object"}, "strict": True},
    }
    assert parse(text={"format": {"type": "json_object"}}).chat_body([])["response_format"] == {"type": "json_object"}


def test_function_calls_and_their_outputs_become_tool_messages():
    items = normalize_input(
        [
            {"role": "user", "content": "weather?"},
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": '{"x": 1}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
            {"type": "function_call_output", "call_id": "call_2", "output": ""},
        ]
    )
    ITEMS.validate_python(items)
    assert conversation_messages(None, [], items) == [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
                {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": '{"x": 1}'}},
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "call_2", "content": ""},
    ]


def input_items_page(items: list[dict], order: str, limit: str, after: str | None) -> dict:
    query = {"order": order, "limit": limit, **({"after": after} if after else {})}
    return PageQuery.parse(query, "desc").of(items, "an input item of this response")


def test_input_item_pages():
    items = normalize_input([{"role": "user", "content": str(i)} for i in range(5)])
    ids = [item["id"] for item in items]
    assert input_items_page(items, "desc", "20", None) == PageQuery.parse({}, "desc").of(items, "")
    newest = input_items_page(items, "desc", "20", None)
    assert [i["id"] for i in newest["data"]] == ids[::-1] and newest["has_more"] is False
    first = input_items_page(items, "asc", "2", None)
    assert [i["id"] for i in first["data"]] == ids[:2] and first["has_more"] and first["last_id"] == ids[1]
    rest = input_items_page(items, "asc", "10", first["last_id"])
    assert [i["id"] for i in rest["data"]] == ids[2:] and rest["has_more"] is False
    for order, limit, after, param in [
        ("up", "2", None, "order"),
        ("asc", "0", None, "limit"),
        ("asc", "x", None, "limit"),
        ("asc", "101", None, "limit"),
        ("asc", "2", "msg_nope", "after"),
    ]:
        with pytest.raises(RequestError) as refused:
            input_items_page(items, order, limit, after)
        assert refused.value.param == param


class ChatStream:
    """A chat completion SSE body, split at awkward places; records whether it was started and closed
    (a generator closed before it started never runs its clean-up)."""

    def __init__(self, events: list[dict | str]):
        raw = b"".join(
            b"data: " + (e.encode() if isinstance(e, str) else json.dumps(e).encode()) + b"\n\n" for e in events
        )
        self.chunks = [raw[i : i + 7] for i in range(0, len(raw), 7)]
        self.started = self.closed = False

    def __aiter__(self):
        return self

    async def __anext__(self) -> bytes:
        self.started = True
        if not self.chunks:
            raise StopAsyncIteration
        return self.chunks.pop(0)

    async def aclose(self) -> None:
        self.closed = True


def chunk(content: str | None = None, finish_reason: str | None = None, **extra) -> dict:
    delta = {"content": content} if content is not None else {}
    return {
        "id": "chatcmpl-1",
        "model": "tiny",
        "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}],
        **extra,
    }


def run_events(chat: ChatStream, keep, logprobs: bool = False) -> list[dict]:
    async def collect() -> list[dict]:
        skeleton = response_skeleton("resp_1", parse(stream=True), 0)
        return [
            json.loads(raw.decode().split("data: ", 1)[1])
            async for raw in response_events(chat, skeleton, "msg_1", keep, logprobs)
        ]

    events = asyncio.run(collect())
    for event in events:
        EVENT.validate_python(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def test_a_chat_stream_becomes_response_events_and_is_kept_before_completion():
    kept = []

    async def keep(response: dict) -> None:
        kept.append(response)

    chat = ChatStream(
        [
            chunk(""),
            chunk("Hel"),
            chunk(),
            chunk("lo", "stop"),
            {"id": "chatcmpl-1", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2}},
            "[DONE]",
        ]
    )
    events = run_events(chat, keep)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["Hel", "lo"]
    final = events[-1]["response"]
    assert kept == [final] and final["usage"]["input_tokens"] == 3 and final["status"] == "completed"
    assert Response.model_validate(final).output_text == "Hello" and chat.closed


def test_a_cut_stream_is_incomplete_and_an_error_fails_it_unkept():
    kept = []

    async def keep(response: dict) -> None:
        kept.append(response)

    cut = run_events(ChatStream([chunk("abc", "length"), "[DONE]"]), keep)
    assert cut[-1]["type"] == "response.incomplete" and kept == [cut[-1]["response"]]
    kept.clear()
    for chat in (
        ChatStream([chunk("a"), {"error": {"message": "no worker left", "code": 503}}, "[DONE]"]),
        ChatStream([chunk("a")]),
    ):
        failed = run_events(chat, keep)
        assert [e["type"] for e in failed[-2:]] == ["error", "response.failed"]
        assert failed[-1]["response"]["status"] == "failed" and failed[-1]["response"]["error"]["message"]
        assert kept == [] and chat.closed


def test_tool_call_deltas_become_function_call_items_with_argument_events():
    async def keep(response: dict) -> None:
        pass

    def call_chunk(delta: dict, finish_reason: str | None = None) -> dict:
        return {"id": "c", "model": "tiny", "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}

    opening = {"index": 0, "id": "call_9", "type": "function", "function": {"name": "f", "arguments": ""}}
    events = run_events(
        ChatStream(
            [
                call_chunk({"role": "assistant", "content": ""}),
                call_chunk({"tool_calls": [opening]}),
                call_chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"a": '}}]}),
                call_chunk({"tool_calls": [{"index": 0, "function": {"arguments": "1}"}}]}, "tool_calls"),
                "[DONE]",
            ]
        ),
        keep,
    )
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    [item] = Response.model_validate(events[-1]["response"]).output
    assert (item.type, item.call_id, item.name, item.arguments) == ("function_call", "call_9", "f", '{"a": 1}')


def test_a_store_failure_fails_the_streamed_response():
    async def keep(response: dict) -> None:
        raise StoreUnavailable("down")

    events = run_events(ChatStream([chunk("a", "stop"), "[DONE]"]), keep)
    assert [e["type"] for e in events[-2:]] == ["error", "response.failed"] and "down" in events[-2]["message"]


@pytest.mark.parametrize("leave_at", [b"response.created", b"response.output_text.delta"])
def test_a_client_leaving_closes_the_started_chat_stream(leave_at):
    async def keep(response: dict) -> None:
        raise AssertionError("nothing to keep")

    chat = ChatStream([chunk("a"), chunk("b"), chunk("c", "stop"), "[DONE]"])

    async def leave() -> None:
        events = response_events(chat, response_skeleton("resp_1", parse(), 0), "msg_1", keep)
        async for raw in events:
            if leave_at in raw:
                break
        await events.aclose()

    asyncio.run(leave())
    assert chat.started and chat.closed


def test_reasoning_deltas_become_a_reasoning_item_before_the_message():
    kept = []

    async def keep(response: dict) -> None:
        kept.append(response)

    chat = ChatStream(
        [
            chunk(""),
            {"id": "c", "model": "tiny", "choices": [{"index": 0, "delta": {"reasoning_content": "Hm, "}}]},
            {"id": "c", "model": "tiny", "choices": [{"index": 0, "delta": {"reasoning_content": "yes."}}]},
            {
                "id": "c",
                "model": "tiny",
                "choices": [{"index": 0, "delta": {"content": "Yes"}, "finish_reason": "stop"}],
            },
            {
                "id": "c",
                "choices": [],
                "usage": {
                    "prompt_tokens": 3,
                    "completion_tokens": 9,
                    "completion_tokens_details": {"reasoning_tokens": 8},
                },
            },
            "[DONE]",
        ]
    )
    events = run_events(chat, keep)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"] == ["reasoning", "message"]
    [done] = [e for e in events if e["type"] == "response.reasoning_text.done"]
    assert done["text"] == "Hm, yes." and done["output_index"] == 0
    final = Response.model_validate(events[-1]["response"])
    thought, said = final.output
    assert thought.type == "reasoning" and [part.text for part in thought.content] == ["Hm, yes."]
    assert said.type == "message" and final.output_text == "Yes"
    assert final.usage.output_tokens_details.reasoning_tokens == 8 and kept == [events[-1]["response"]]


def test_a_message_with_reasoning_is_a_reasoning_item_then_the_message():
    skeleton = response_skeleton("resp_1", parse(), 0)
    output = assistant_output("msg_1", {"content": "Yes", "reasoning_content": "Hm."}, "completed")
    usage = {"prompt_tokens": 3, "completion_tokens": 5, "completion_tokens_details": {"reasoning_tokens": 4}}
    parsed = Response.model_validate(finished_response(skeleton, output, "stop", usage, None))
    assert [item.type for item in parsed.output] == ["reasoning", "message"]
    assert parsed.output[0].content[0].text == "Hm." and parsed.output_text == "Yes"
    assert parsed.usage.output_tokens_details.reasoning_tokens == 4
    # Cut while reasoning: the reasoning alone, no empty message.
    cut = assistant_output("msg_1", {"content": "", "reasoning_content": "Hm"}, "incomplete")
    assert [item["type"] for item in cut] == ["reasoning"]
    assert responses_usage(None)["output_tokens_details"] == {"reasoning_tokens": 0}


def test_reasoning_items_in_input_are_the_next_assistant_message_s_reasoning_content():
    items = normalize_input(
        [
            {"role": "user", "content": "add them"},
            {
                "type": "reasoning",
                "id": "rs_1",
                "summary": [],
                "content": [{"type": "reasoning_text", "text": "Use f."}],
            },
            {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "3"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "It is 3."}], "encrypted_content": None},
            {"role": "assistant", "content": "3"},
            {"type": "reasoning", "summary": [{"type": "summary_text", "text": "left over"}]},
            {"role": "user", "content": "thanks"},
        ]
    )
    ITEMS.validate_python(items)
    assert conversation_messages(None, [], items) == [
        {"role": "user", "content": "add them"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            "reasoning_content": "Use f.",
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
        {"role": "assistant", "content": "3", "reasoning_content": "It is 3."},
        {"role": "user", "content": "thanks"},
    ]


@pytest.mark.parametrize(
    "item,param",
    [
        ({"type": "reasoning"}, "input[0].summary"),
        ({"type": "reasoning", "summary": [{"type": "reasoning_text", "text": "x"}]}, "input[0].summary[0]"),
        ({"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text"}]}, "input[0].content[0]"),
        ({"type": "reasoning", "summary": [], "encrypted_content": "gAAA"}, "input[0].encrypted_content"),
    ],
)
def test_bad_reasoning_items_name_the_field(item, param):
    with pytest.raises(RequestError) as refused:
        normalize_input([item])
    assert refused.value.param == param


def entry(token: str) -> dict:
    return {"token": token, "logprob": -0.5, "bytes": list(token.encode()), "top_logprobs": []}


def test_output_text_logprobs_are_asked_of_the_chat_request_and_add_up_over_the_stream():
    asked = parse(include=["message.output_text.logprobs"], top_logprobs=3)
    assert asked.chat_body([])["logprobs"] is True and asked.chat_body([])["top_logprobs"] == 3
    assert "logprobs" not in parse(top_logprobs=3).chat_body([])
    with pytest.raises(RequestError) as refused:
        parse(top_logprobs=21)
    assert refused.value.param == "top_logprobs"

    async def keep(response: dict) -> None:
        pass

    def with_logprobs(content: str | None, token: str, finish_reason: str | None = None) -> dict:
        event = chunk(content, finish_reason)
        event["choices"][0]["logprobs"] = {"content": [entry(token)]}
        return event

    # The middle token brings no text of its own (part of a character): its logprobs wait for text.
    chat = ChatStream(
        [with_logprobs("He", "He"), with_logprobs(None, "\xa0"), with_logprobs("llo", "llo", "stop"), "[DONE]"]
    )
    events = run_events(chat, keep, logprobs=True)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [[x["token"] for x in d["logprobs"]] for d in deltas] == [["He"], ["\xa0", "llo"]]
    [done] = [e for e in events if e["type"] == "response.output_item.done"]
    assert [x["token"] for x in done["item"]["content"][0]["logprobs"]] == ["He", "\xa0", "llo"]
    final = Response.model_validate(events[-1]["response"])
    assert [x.token for x in final.output[0].content[0].logprobs] == ["He", "\xa0", "llo"]
    message = {"role": "assistant", "content": "Hello"}
    [item] = assistant_output("m", message, "completed", [entry("He"), entry("llo")])
    assert [x["token"] for x in item["content"][0]["logprobs"]] == ["He", "llo"]
