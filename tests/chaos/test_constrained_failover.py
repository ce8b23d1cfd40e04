"""A constrained stream (a JSON schema, a forced tool call) whose worker is killed with -9 mid-way
continues on another worker with its grammar rebuilt from the tokens so far: the output is valid
and, with a seed, identical to the run without the fault."""

from __future__ import annotations

import json
import os
import signal

import jsonschema
import pytest

from tests.support.failover_trio import failover_trio
from tests.support.streams import read_stream
from tests.support.workers import MODEL, tiny_worker_args

NUMBERS = {
    "type": "object",
    "properties": {
        "label": {"type": "string", "minLength": 3, "maxLength": 6},
        "values": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": 999},
            "minItems": 25,
            "maxItems": 25,
        },
    },
    "required": ["label", "values"],
    "additionalProperties": False,
}
TOOL = {
    "type": "function",
    "function": {
        "name": "record",
        "parameters": {
            "type": "object",
            "properties": {
                "note": {"type": "string", "minLength": 30, "maxLength": 40},
                "count": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["note", "count"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def trio(long_tiny_model_dir, shoal_cache_dir, tmp_path_factory):
    """Three workers at 10 ms a step behind a router with a 1 s token deadline: each test kills one,
    and the rest carry its stream on."""
    common = tiny_worker_args(long_tiny_model_dir, MODEL, step_delay_ms=10)
    yield from failover_trio(common, shoal_cache_dir, tmp_path_factory.mktemp("constrained-failover"))


def kill(processes):
    return lambda worker: os.kill(processes[worker].pid, signal.SIGKILL)


def test_a_json_schema_stream_survives_its_worker_killed(trio):
    url, processes = trio
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "numbers please"}],
        "temperature": 1.0,
        "seed": 21,
        "max_tokens": 400,
        "stream": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "numbers", "schema": NUMBERS}},
    }
    clean = read_stream(url, body)
    jsonschema.validate(json.loads(clean["text"]), NUMBERS)
    faulty = read_stream(url, body, fault=kill(processes), after_tokens=30)
    assert processes[faulty["worker"]].wait(timeout=10) == -signal.SIGKILL  # it went on elsewhere
    assert faulty["ids"] == clean["ids"] and faulty["text"] == clean["text"]
    assert faulty["finish_reason"] == clean["finish_reason"] == "stop"


def test_a_forced_tool_call_stream_survives_its_worker_killed_mid_arguments(trio):
    url, processes = trio
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "write it down"}],
        "temperature": 1.0,
        "seed": 5,
        "max_tokens": 300,
        "stream": True,
        "tools": [TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    clean = read_stream(url, body)
    [call] = clean["tool_calls"]
    jsonschema.validate(json.loads(call["arguments"]), TOOL["function"]["parameters"])
    # The call opens with about 25 tokens of markup and name; 45 tokens in, its arguments stream.
    faulty = read_stream(url, body, fault=kill(processes), after_tokens=45)
    assert processes[faulty["worker"]].wait(timeout=10) == -signal.SIGKILL
    assert faulty["ids"] == clean["ids"] and faulty["tool_calls"] == clean["tool_calls"]
    assert faulty["text"] == clean["text"] == "" and faulty["finish_reason"] == "tool_calls"
