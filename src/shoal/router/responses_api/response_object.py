"""The OpenAI Response object (as `openai.types.responses.Response` parses it) and its parts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal.router.responses_api.message_items import output_message, output_text_part

if TYPE_CHECKING:
    from shoal.router.responses_api.responses_request import ResponsesRequest


def response_skeleton(response_id: str, request: ResponsesRequest, created_at: int) -> dict:
    """The response while it is generated: status "in_progress", no output, no usage. The settings
    echoed are the effective ones (OpenAI's defaults where the request left them out)."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "model": request.model,
        "output": [],
        "usage": None,
        "previous_response_id": request.previous_response_id,
        "instructions": request.instructions,
        "store": request.store,
        "metadata": request.metadata,
        "user": request.user,
        "temperature": 1.0 if request.temperature is None else request.temperature,
        "top_p": 1.0 if request.top_p is None else request.top_p,
        "max_output_tokens": request.max_output_tokens,
        "parallel_tool_calls": request.parallel_tool_calls,
        "tool_choice": request.tool_choice,
        "tools": [],
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "background": False,
    }


def responses_usage(chat_usage: dict | None) -> dict:
    """Chat completion usage in the Responses vocabulary."""
    chat_usage = chat_usage or {}
    input_tokens = chat_usage.get("prompt_tokens", 0)
    output_tokens = chat_usage.get("completion_tokens", 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "total_tokens": input_tokens + output_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": 0},
    }


def finished_response(
    skeleton: dict, message_id: str, text: str, finish_reason: str | None, chat_usage: dict | None, model: str | None
) -> dict:
    """Invariant: status is "incomplete" (reason max_output_tokens) exactly when the output was cut
    by its token limit (finish_reason "length"), else "completed"."""
    cut = finish_reason == "length"
    status = "incomplete" if cut else "completed"
    return {
        **skeleton,
        "status": status,
        "model": model or skeleton["model"],
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None,
        "output": [output_message(message_id, status, [output_text_part(text)])],
        "usage": responses_usage(chat_usage),
    }


def failed_response(skeleton: dict, message: str) -> dict:
    return {**skeleton, "status": "failed", "error": {"code": "server_error", "message": message}}
