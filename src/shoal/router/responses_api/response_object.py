"""The OpenAI Response object (as `openai.types.responses.Response` parses it) and its parts."""

from __future__ import annotations

from typing import TYPE_CHECKING

from shoal.router.responses_api.ids import new_function_call_id, new_reasoning_id
from shoal.router.responses_api.message_items import (
    function_call_item,
    output_message,
    output_text_part,
    reasoning_item,
    reasoning_text_part,
)

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
        "tools": request.tools,
        "text": {"format": request.text_format, "verbosity": request.verbosity or "medium"},
        "reasoning": {"effort": request.reasoning_effort, "summary": None},
        "truncation": request.truncation,
        "background": request.background,
        "service_tier": "default" if request.service_tier in (None, "auto") else request.service_tier,
        "prompt_cache_key": request.prompt_cache_key,
        "safety_identifier": request.safety_identifier,
        "max_tool_calls": request.max_tool_calls,
        "top_logprobs": request.top_logprobs,
    }


def responses_usage(chat_usage: dict | None) -> dict:
    """Chat completion usage in the Responses vocabulary (output tokens include the reasoning
    tokens, as they do in OpenAI's)."""
    chat_usage = chat_usage or {}
    input_tokens = chat_usage.get("prompt_tokens", 0)
    output_tokens = chat_usage.get("completion_tokens", 0)
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    reasoning = (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
    return {
        "input_tokens": input_tokens,
        "output_tokens": output_tokens,
        "total_tokens": input_tokens + output_tokens,
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens_details": {"reasoning_tokens": reasoning},
    }


def output_status(finish_reason: str | None) -> str:
    """ "incomplete" exactly when the output was cut by its token limit (finish_reason "length")."""
    return "incomplete" if finish_reason == "length" else "completed"


def assistant_output(message_id: str, message: dict, status: str, logprobs: list[dict] | None = None) -> list[dict]:
    """A chat completion's message as output items: a reasoning item (when it has reasoning), the
    message (when it has text, or nothing else; with the output's token `logprobs` where asked),
    then one function_call item per tool call."""
    calls = message.get("tool_calls") or []
    reasoning = message.get("reasoning_content")
    thought = [reasoning_item(new_reasoning_id(), status, [reasoning_text_part(reasoning)])] if reasoning else []
    items = [output_message(message_id, status, [output_text_part(message.get("content") or "", logprobs)])]
    if (calls or thought) and not message.get("content"):
        items = []
    return (
        thought
        + items
        + [
            function_call_item(
                new_function_call_id(), call["id"], call["function"]["name"], call["function"]["arguments"]
            )
            for call in calls
        ]
    )


def finished_response(
    skeleton: dict, output: list[dict], finish_reason: str | None, chat_usage: dict | None, model: str | None
) -> dict:
    """Invariant: status is "incomplete" (reason max_output_tokens) exactly when the output was cut
    by its token limit (finish_reason "length"), else "completed"."""
    status = output_status(finish_reason)
    return {
        **skeleton,
        "status": status,
        "model": model or skeleton["model"],
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "output": output,
        "usage": responses_usage(chat_usage),
    }


def failed_response(skeleton: dict, message: str) -> dict:
    return {**skeleton, "status": "failed", "error": {"code": "server_error", "message": message}}
