"""A non-streamed response assembled from the chunks the router relayed (from one worker, or from
two when the stream migrated): text, reasoning and tool calls are their deltas joined."""

from __future__ import annotations

from shoal.router.streams.assembly import assemble


def chunk(delta: dict, token_ids: list[int], finish_reason: str | None = None) -> dict:
    choice = {"index": 0, "delta": delta, "token_ids": token_ids, "seed": 3, "finish_reason": finish_reason}
    return {"id": "chatcmpl-1", "created": 1, "model": "m", "choices": [choice]}


def test_reasoning_deltas_make_the_message_s_reasoning_content():
    usage = {"prompt_tokens": 4, "completion_tokens": 5, "completion_tokens_details": {"reasoning_tokens": 3}}
    events = [
        chunk({"role": "assistant", "content": ""}, []),
        chunk({"reasoning_content": "Hm"}, [1]),
        chunk({}, [2]),  # a marker held back: no text yet
        chunk({"reasoning_content": ", yes."}, [3]),  # from the worker the stream moved to
        chunk({"content": "Yes"}, [4]),
        chunk({"content": "!"}, [5], "stop"),
        {"id": "chatcmpl-1", "choices": [], "usage": usage},
    ]
    [choice] = assemble(events, chat=True)["choices"]
    assert choice["message"] == {"role": "assistant", "content": "Yes!", "reasoning_content": "Hm, yes."}
    assert choice["token_ids"] == [1, 2, 3, 4, 5] and choice["finish_reason"] == "stop"
    assert assemble(events, chat=True)["usage"] == usage


def test_without_reasoning_the_message_has_no_reasoning_content_and_calls_keep_their_shape():
    call = {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    events = [
        chunk({"reasoning": "vLLM's name"}, [1]),
        chunk({"tool_calls": [call]}, [2]),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": "{}"}}]}, [3], "tool_calls"),
    ]
    message = assemble(events, chat=True)["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": None,
        "reasoning_content": "vLLM's name",
        "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    plain = assemble([chunk({"content": "hi"}, [1], "stop")], chat=True)["choices"][0]["message"]
    assert plain == {"role": "assistant", "content": "hi"}
