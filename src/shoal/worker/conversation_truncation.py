"""`truncation: "auto"` (the Responses API's, carried on chat requests): a conversation whose prompt
and output room exceed the context drops whole messages from its middle, as OpenAI's does: the
oldest after the leading system and developer messages first, with the tool results of a dropped
call, until it fits; the last message always stays. "disabled" (the default) sends the conversation
whole, and one over the context is a 400."""

from __future__ import annotations

from collections.abc import Callable

from shoal.worker.protocol import ChatCompletionRequest, ChatMessage


def fitted(
    body: ChatCompletionRequest,
    prompt_of: Callable[[ChatCompletionRequest], tuple[str, list[int]]],
    max_model_len: int,
) -> tuple[ChatCompletionRequest, str, list[int]]:
    """The request (its messages cut as truncation allows), and its prompt text and ids as
    `prompt_of` renders them."""
    text, prompt_ids = prompt_of(body)
    room = body.max_completion_tokens or body.max_tokens or 1
    while body.truncation == "auto" and len(prompt_ids) + room > max_model_len:
        shorter = _without_oldest(body.messages)
        if shorter is None:
            break
        body = body.model_copy(update={"messages": shorter})
        text, prompt_ids = prompt_of(body)
    return body, text, prompt_ids


def _without_oldest(messages: list[ChatMessage]) -> list[ChatMessage] | None:
    """The messages without the oldest droppable one (and the tool results that followed it);
    None when only the leading instructions and the last message are left."""
    first = next((i for i, m in enumerate(messages) if m.role not in ("system", "developer")), len(messages))
    if first >= len(messages) - 1:
        return None
    end = first + 1
    while end < len(messages) - 1 and messages[end].role == "tool":
        end += 1
    return messages[:first] + messages[end:]
