"""The one SSE module: events written by the worker, the router and the Responses API read back by
every reader, however the bytes are split; comments (keep-alives) and other fields are skipped."""

from __future__ import annotations

import asyncio
import math

import pytest

from shoal.protocol.keep_alive import KeepAlive
from shoal.protocol.sse import (
    DONE,
    data_event,
    data_of,
    is_done,
    json_data,
    json_events,
    named_event,
)


def test_events_read_back_as_written():
    assert data_of(data_event({"a": 1})) == b'{"a": 1}'
    assert data_of(data_event(b'{"b":2}')) == b'{"b":2}'
    assert is_done(data_of(DONE)) and not is_done(b'{"a": 1}')
    name, data, blank = named_event("response.created", {"type": "response.created"}).split(b"\n")[:3]
    assert name == b"event: response.created" and json_data(data_of(data)) == {"type": "response.created"}
    assert blank == b""


@pytest.mark.parametrize(
    "line", [b": keep-alive", KeepAlive(busy_s=1.0, step_s=2.0).encode(), b"event: x", b"", b"id: 7", b"datum: 1"]
)
def test_comments_and_other_fields_carry_no_data(line):
    assert data_of(line) is None


def test_the_spec_allows_data_without_its_space_and_text_lines():
    assert data_of("data:{}\r\n") == b"{}" and data_of("data: [DONE]") == b"[DONE]"
    with pytest.raises(ValueError):
        json_data(b"[1, 2]")


def test_json_events_stop_at_done_however_the_bytes_are_split():
    stream = data_event({"n": 1}) + b": keep-alive\n\n" + data_event({"n": 2}) + DONE + data_event({"n": 3})

    async def chunks(size: int):
        for start in range(0, len(stream), size):
            yield stream[start : start + size]

    async def read(size: int) -> list[dict]:
        return [event async for event in json_events(chunks(size))]

    for size in (1, 3, 7, len(stream)):
        assert asyncio.run(read(size)) == [{"n": 1}, {"n": 2}]


def test_event_json_with_python_s_non_finite_numbers_is_read_and_anything_not_an_object_is_refused():
    assert json_data(b'{"logprob": -Infinity, "score": NaN}')["logprob"] == -math.inf
    assert json_data(b'{"choices": [{"delta": {"content": "hi"}}]}')["choices"][0]["delta"]["content"] == "hi"
    for bad in (b"[1, 2]", b"{", b"nope"):
        with pytest.raises(ValueError):
            json_data(bad)
