"""Which engine can continue a broken stream, and what it is sent."""

from __future__ import annotations

import pytest

from shoal.router.streams.continuation import can_continue, continuation_body, with_token_ids_asked
from shoal.router.streams.relay import StreamProgress

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Tell me"}], "max_tokens": 20, "min_tokens": 5}


def progress(text: str = "Once upon", token_ids: list[int] | None = None, tokens: int = 2) -> StreamProgress:
    return StreamProgress(token_ids=token_ids or [], output=[text], tokens=tokens, text_chars=len(text), seed=7)


def test_a_shoal_worker_continues_from_the_token_ids_with_the_same_seed():
    sent = continuation_body(CHAT, progress(token_ids=[11, 12]), "shoal", chat=True)
    assert sent["resume_token_ids"] == [11, 12] and sent["resume_text_offset"] == 9 and sent["seed"] == 7
    assert sent["messages"] == CHAT["messages"] and sent["max_tokens"] == 20


def test_without_token_ids_a_chat_continues_as_an_open_assistant_message():
    sent = continuation_body(CHAT, progress(), "vllm", chat=True)
    assert sent["messages"] == [*CHAT["messages"], {"role": "assistant", "content": "Once upon"}]
    assert sent["continue_final_message"] is True and sent["add_generation_prompt"] is False
    assert (sent["max_tokens"], sent["min_tokens"]) == (18, 3)
    assert "resume_token_ids" not in sent


def test_a_client_s_own_assistant_prefix_is_extended_not_repeated():
    body = {
        **CHAT,
        "messages": [*CHAT["messages"], {"role": "assistant", "content": "Sure: "}],
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    sent = continuation_body(body, progress(), "shoal", chat=True)
    assert sent["messages"][-1] == {"role": "assistant", "content": "Sure: Once upon"}
    assert len(sent["messages"]) == 2


def test_a_text_completion_continues_after_the_text_and_does_not_echo_again():
    body = {"model": "m", "prompt": "Roses are", "max_tokens": 10, "echo": True}
    sent = continuation_body(body, progress(" red,", tokens=2), None, chat=False)
    assert sent["prompt"] == "Roses are red," and sent["echo"] is False and sent["max_tokens"] == 8


def test_a_token_id_completion_continues_with_the_token_ids_where_the_engine_takes_them():
    body = {"model": "m", "prompt": [1, 2, 3], "max_tokens": 4}
    relayed = progress(" red", token_ids=[9, 10], tokens=2)
    assert continuation_body(body, relayed, "vllm", chat=False)["prompt"] == [1, 2, 3, 9, 10]
    assert can_continue("vllm", relayed, body, chat=False)
    assert not can_continue(None, relayed, body, chat=False)  # llama.cpp's server takes text prompts only
    assert not can_continue("vllm", progress(" red"), body, chat=False)  # the ids are not known


@pytest.mark.parametrize(
    "engine,token_ids,expected",
    [
        ("shoal", [5], True),
        ("shoal", [], True),
        ("vllm", [], True),
        ("sglang", [], True),
        ("llama.cpp", [], False),
        (None, [], False),
    ],
)
def test_which_engines_continue_a_chat(engine, token_ids, expected):
    assert can_continue(engine, progress(token_ids=token_ids), CHAT, chat=True) is expected


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_object"}},
        {"structured_outputs": {"regex": "a+"}},
        {"tools": [{"type": "function", "function": {"name": "f"}}]},
    ],
)
def test_constrained_output_continues_only_token_exact(extra):
    body = {**CHAT, **extra}
    assert not can_continue("vllm", progress(), body, chat=True)
    assert not can_continue("shoal", progress(), body, chat=True)
    assert can_continue("shoal", progress(token_ids=[3, 4]), body, chat=True)


def test_plain_text_response_format_does_not_constrain():
    assert can_continue("vllm", progress(), {**CHAT, "response_format": {"type": "text"}}, chat=True)


def test_streamed_tool_calls_are_not_written_back_as_text():
    called = progress()
    called.tool_calls = True
    assert not can_continue("vllm", called, CHAT, chat=True)


def test_vllm_is_asked_for_its_token_ids_and_nothing_else_is():
    assert with_token_ids_asked(CHAT, "vllm") == {**CHAT, "return_token_ids": True}
    assert with_token_ids_asked(CHAT, "shoal") is CHAT and with_token_ids_asked(CHAT, None) is CHAT


def test_streamed_reasoning_continues_only_token_exact():
    thought = progress(token_ids=[3, 4])
    thought.reasoning = True
    assert can_continue("shoal", thought, CHAT, chat=True)
    assert continuation_body(CHAT, thought, "shoal", chat=True)["resume_text_offset"] == thought.text_chars
    thought.token_ids = []
    assert not can_continue("vllm", thought, CHAT, chat=True)
    assert not can_continue("shoal", thought, CHAT, chat=True)
