"""Merging the streams of n single-choice requests into one."""

from __future__ import annotations

import asyncio
import json

from shoal.router.streams.choice_fanout import choice_bodies, merged
from shoal.router.streams.failover import DONE, _error_event


def event(payload: dict) -> bytes:
    return b"data: " + json.dumps(payload).encode() + b"\n\n"


async def stream(*chunks: bytes):
    for chunk in chunks:
        await asyncio.sleep(0)
        yield chunk


def collect(streams, include_usage: bool) -> list:
    async def run():
        return [chunk async for chunk in merged(streams, include_usage)]

    return asyncio.run(run())


def test_choices_are_numbered_by_stream_usage_summed_and_one_done_ends_it():
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    chunks = collect(
        [
            stream(  # events that arrived together come in one chunk
                event({"id": "a", "choices": [{"index": 0, "token_ids": [1, 2]}]})
                + event({"choices": [], "usage": usage})
                + DONE,
            ),
            stream(
                event({"id": "b", "choices": [{"index": 0, "token_ids": [3, 4]}]}),
                event({"choices": [], "usage": usage}),
                DONE,
            ),
        ],
        include_usage=True,
    )
    assert chunks[-1] == DONE and chunks.count(DONE) == 1
    events = [json.loads(c[6:]) for c in chunks[:-1]]
    assert sorted(e["choices"][0]["index"] for e in events if e["choices"]) == [0, 1]
    assert {e["id"] for e in events} == {"a"}
    assert events[-1]["usage"] == {"prompt_tokens": 5, "completion_tokens": 4, "total_tokens": 9}


def test_a_choice_that_fails_passes_its_error_on_and_the_others_finish():
    chunks = collect(
        [
            stream(event({"id": "a", "choices": [{"index": 0, "token_ids": [1]}]}), DONE),
            stream(_error_event("no worker left to continue this stream"), DONE),
        ],
        include_usage=False,
    )
    events = [json.loads(c[6:]) for c in chunks if c != DONE]
    assert any("error" in e for e in events) and any(e.get("choices") for e in events)
    assert chunks[-1] == DONE and chunks.count(DONE) == 1


def test_choice_i_runs_with_seed_plus_i():
    bodies = choice_bodies({"n": 3, "seed": 10, "stream": False}, force_stream=True)
    assert [(b["n"], b["seed"], b["stream"]) for b in bodies] == [(1, 10, True), (1, 11, True), (1, 12, True)]
    assert choice_bodies({"n": 1, "stream": True}, force_stream=False) == [{"n": 1, "stream": True}]


def test_reasoning_tokens_are_summed_over_the_choices():
    def usage(reasoning: int | None) -> dict:
        details = {"completion_tokens_details": {"reasoning_tokens": reasoning}} if reasoning is not None else {}
        return {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11, **details}

    def final_usage(*reasoning: int | None) -> dict:
        streams = [
            stream(event({"id": "a", "choices": []}), event({"choices": [], "usage": usage(r)}), DONE)
            for r in reasoning
        ]
        return json.loads(collect(streams, include_usage=True)[-2][6:])["usage"]

    assert final_usage(4, 2)["completion_tokens_details"] == {"reasoning_tokens": 6}
    assert final_usage(4, 2, 3)["completion_tokens"] == 18
    assert "completion_tokens_details" not in final_usage(None, None)
