"""truncation "auto": whole messages leave a conversation over the context from its middle (the
oldest after its instructions, with a dropped call's tool results), until it fits."""

from __future__ import annotations

from shoal.worker.conversation_truncation import fitted
from shoal.worker.protocol import ChatCompletionRequest

CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


def conversation(truncation: str, max_tokens: int = 10) -> ChatCompletionRequest:
    return ChatCompletionRequest(
        model="m",
        max_tokens=max_tokens,
        truncation=truncation,
        messages=[
            {"role": "system", "content": "s" * 10},
            {"role": "user", "content": "a" * 30},
            {"role": "assistant", "content": None, "tool_calls": [CALL]},
            {"role": "tool", "tool_call_id": "c1", "content": "t" * 30},
            {"role": "assistant", "content": "b" * 30},
            {"role": "user", "content": "c" * 20},
        ],
    )


def prompt_of(body: ChatCompletionRequest) -> tuple[str, list[int]]:
    """One token a character of the messages' text."""
    text = "".join(message.text() for message in body.messages)
    return text, list(range(len(text)))


def test_auto_drops_the_oldest_messages_after_the_instructions_until_it_fits():
    body, text, ids = fitted(conversation("auto"), prompt_of, max_model_len=70)
    assert [m.role for m in body.messages] == ["system", "assistant", "user"]  # the call went with its result
    assert text == "s" * 10 + "b" * 30 + "c" * 20 and len(ids) + 10 <= 70


def test_the_instructions_and_the_last_message_always_stay():
    body, _, ids = fitted(conversation("auto"), prompt_of, max_model_len=20)
    assert [m.role for m in body.messages] == ["system", "user"] and len(ids) == 30  # still over: a 400 later


def test_disabled_and_a_conversation_that_fits_are_sent_whole():
    for truncation, limit in (("disabled", 50), ("auto", 1000)):
        body, _, ids = fitted(conversation(truncation), prompt_of, max_model_len=limit)
        assert len(body.messages) == 6 and len(ids) == 120
