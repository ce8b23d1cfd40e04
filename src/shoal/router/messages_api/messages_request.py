"""A `POST /v1/messages` (or `/v1/messages/count_tokens`) body, validated, and the chat completion
request it becomes.

Fields and their chat meaning: `system` and `messages` (content_blocks), `max_tokens`,
`stop_sequences` (stop), `temperature`, `top_p`, `top_k`, `stream`, `metadata.user_id` (user: the
end-user key), `tools` ({name, description, input_schema, strict}: function tools), `tool_choice`
(auto, any as "required", tool as the named function, none; `disable_parallel_tool_use` as
parallel_tool_calls false), `service_tier` (auto, and standard_only as the default tier),
`cache_control` (served by automatic prefix caching), `thinking` (enabled and disabled as the
chat template's `enable_thinking`, which thinking templates read; adaptive leaves the template's
default; `budget_tokens` is checked as Anthropic checks it, and the thinking it bounds counts
toward max_tokens, which the worker enforces). A final assistant turn is a prefill: the answer
continues it. Every other field is a RequestError naming it.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.router.body_fields import known_fields, number_in_range, typed_field
from shoal.router.messages_api.content_blocks import chat_messages, check_cache_control, system_messages
from shoal.router.placement.route_request import RequestError

COMMON_FIELDS = ("model", "messages", "system", "tools", "tool_choice", "thinking", "cache_control", "output_config")
MESSAGES_FIELDS = (
    *COMMON_FIELDS,
    "max_tokens",
    "metadata",
    "stop_sequences",
    "stream",
    "temperature",
    "top_p",
    "top_k",
    "service_tier",
)
# Fields of shoal's workers' chat requests a Messages request may carry (passed on unchanged, the
# worker validates them); count_tokens takes only the one that changes the rendered prompt.
SHOAL_EXTENSIONS = ("seed", "ignore_eos", "min_p", "repetition_penalty", "priority", "chat_template_kwargs")
COUNT_EXTENSIONS = ("chat_template_kwargs",)
TOOL_FIELDS = ("type", "name", "description", "input_schema", "cache_control", "strict")
TOOL_CHOICE_FIELDS = {
    "auto": {"type", "disable_parallel_tool_use"},
    "any": {"type", "disable_parallel_tool_use"},
    "tool": {"type", "disable_parallel_tool_use", "name"},
    "none": {"type"},
}
SERVICE_TIERS = {"auto": "auto", "standard_only": "default"}
MIN_THINKING_BUDGET = 1024


def _positive(body: dict, name: str) -> int | None:
    value = typed_field(body, name, int, "a positive integer")
    if value is not None and value < 1:
        raise RequestError(f"`{name}` must be a positive integer", name)
    return value


def _tools(body: dict) -> list[dict]:
    """Client tools as chat function tools."""
    tools = typed_field(body, "tools", list, "a list", [])
    chat = []
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        kind = tool.get("type") if isinstance(tool, dict) else "not an object"
        if kind not in (None, "custom"):
            raise RequestError(f"`{where}.type` {kind!r} is not supported; only client tools are", f"{where}.type")
        unknown = sorted(set(tool) - set(TOOL_FIELDS))
        if unknown:
            raise RequestError(f"`{where}.{unknown[0]}` is not supported", f"{where}.{unknown[0]}")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise RequestError(f"`{where}.name` must be a non-empty string", f"{where}.name")
        if not isinstance(tool.get("input_schema"), dict):
            raise RequestError(f"`{where}.input_schema` must be a JSON schema object", f"{where}.input_schema")
        check_cache_control(tool.get("cache_control"), f"{where}.cache_control")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        function.update({k: tool[k] for k in ("description", "strict") if tool.get(k) is not None})
        chat.append({"type": "function", "function": function})
    return chat


def _tool_choice(body: dict, tools: list[dict]) -> tuple[str | dict | None, bool | None]:
    """(the chat tool_choice, parallel_tool_calls), each None when the request leaves it."""
    choice = typed_field(body, "tool_choice", dict, "an object")
    if choice is None:
        return None, None
    kind = choice.get("type")
    if kind not in TOOL_CHOICE_FIELDS:
        raise RequestError("`tool_choice.type` must be one of auto, any, tool, none", "tool_choice.type")
    unknown = sorted(set(choice) - TOOL_CHOICE_FIELDS[kind])
    if unknown:
        raise RequestError(f"`tool_choice.{unknown[0]}` is not supported with type {kind}", f"tool_choice.{unknown[0]}")
    disable = choice.get("disable_parallel_tool_use")
    if disable is not None and not isinstance(disable, bool):
        raise RequestError("`tool_choice.disable_parallel_tool_use` must be a boolean", "tool_choice")
    names = [tool["function"]["name"] for tool in tools]
    if kind in ("any", "tool") and not names:
        raise RequestError(f"`tool_choice` {kind} needs `tools`", "tool_choice")
    if kind == "tool" and choice.get("name") not in names:
        raise RequestError(f"`tool_choice.name` {choice.get('name')!r} is not in `tools`", "tool_choice.name")
    chat = (
        {"type": "function", "function": {"name": choice["name"]}}
        if kind == "tool"
        else {"auto": "auto", "any": "required", "none": "none"}[kind]
    )
    return chat, None if disable is None else not disable


def _enable_thinking(body: dict, max_tokens: int | None) -> bool | None:
    """The chat template's enable_thinking for `thinking`; None where the template decides."""
    thinking = typed_field(body, "thinking", dict, "an object")
    if thinking is None:
        return None
    kind = thinking.get("type")
    fields = {"enabled": {"type", "budget_tokens", "display"}, "disabled": {"type"}, "adaptive": {"type", "display"}}
    if kind not in fields:
        raise RequestError("`thinking.type` must be one of enabled, disabled, adaptive", "thinking.type")
    unknown = sorted(name for name in set(thinking) - fields[kind])
    if thinking.get("display") is not None:
        unknown.insert(0, "display")  # thinking is shown whole, never summarized or omitted
    if unknown:
        raise RequestError(f"`thinking.{unknown[0]}` is not supported", f"thinking.{unknown[0]}")
    if kind == "enabled":
        budget = thinking.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or budget < MIN_THINKING_BUDGET:
            raise RequestError(
                f"`thinking.budget_tokens` must be an integer of at least {MIN_THINKING_BUDGET}",
                "thinking.budget_tokens",
            )
        if max_tokens is not None and budget >= max_tokens:
            raise RequestError("`thinking.budget_tokens` must be less than `max_tokens`", "thinking.budget_tokens")
    return {"enabled": True, "disabled": False, "adaptive": None}[kind]


def _template_kwargs(body: dict, enable_thinking: bool | None) -> dict | None:
    kwargs = typed_field(body, "chat_template_kwargs", dict, "an object")
    if enable_thinking is None:
        return kwargs
    if kwargs and "enable_thinking" in kwargs:
        raise RequestError("give `thinking` or chat_template_kwargs.enable_thinking, not both", "thinking")
    return {**(kwargs or {}), "enable_thinking": enable_thinking}


def _user(body: dict) -> str | None:
    metadata = typed_field(body, "metadata", dict, "an object", {})
    unknown = sorted(set(metadata) - {"user_id"})
    if unknown:
        raise RequestError(f"`metadata.{unknown[0]}` is not supported", f"metadata.{unknown[0]}")
    user = metadata.get("user_id")
    if user is not None and not isinstance(user, str):
        raise RequestError("`metadata.user_id` must be a string", "metadata.user_id")
    return user


# Anthropic's output_config.effort as the chat templates' reasoning_effort (the top two levels have
# no stronger counterpart there).
EFFORTS = {"low": "low", "medium": "medium", "high": "high", "xhigh": "high", "max": "high"}


def _output_config(body: dict) -> tuple[str | None, dict | None]:
    """output_config as (reasoning_effort, a chat response_format): `effort` goes to the family's
    template switch (reported unused where the template has none); `format` (json_schema) is a
    strict JSON schema constraint on the answer, as Anthropic's structured outputs are."""
    config = typed_field(body, "output_config", dict, "an object", {})
    unknown = sorted(set(config) - {"effort", "format"})
    if unknown:
        raise RequestError(f"`output_config.{unknown[0]}` is not supported", f"output_config.{unknown[0]}")
    effort = config.get("effort")
    if effort is not None and effort not in EFFORTS:
        raise RequestError(f"`output_config.effort` must be one of {', '.join(EFFORTS)}", "output_config.effort")
    output_format = config.get("format")
    if output_format is None:
        return EFFORTS.get(effort), None
    if (
        not isinstance(output_format, dict)
        or output_format.get("type") != "json_schema"
        or not isinstance(output_format.get("schema"), dict)
        or set(output_format) - {"type", "schema"}
    ):
        raise RequestError(
            '`output_config.format` must be {"type": "json_schema", "schema": {...}}', "output_config.format"
        )
    schema = {"name": "output", "schema": output_format["schema"], "strict": True}
    return EFFORTS.get(effort), {"type": "json_schema", "json_schema": schema}


def _stop(body: dict) -> list[str] | None:
    stop = typed_field(body, "stop_sequences", list, "a list of strings")
    if stop is not None and not all(isinstance(s, str) and s for s in stop):
        raise RequestError("`stop_sequences` must be a list of non-empty strings", "stop_sequences")
    return stop


@dataclass(frozen=True)
class MessagesRequest:
    """Invariants: every field has its type and range; `messages` are chat messages (system
    first, if any) and end with a user or tool message unless `prefill`; `extensions` holds only
    SHOAL_EXTENSIONS other than chat_template_kwargs (folded into `template_kwargs`). A
    count_tokens request has no max_tokens and does not stream."""

    model: str
    messages: list[dict]
    prefill: bool
    max_tokens: int | None
    stream: bool
    temperature: float | None
    top_p: float | None
    top_k: int | None
    stop: list[str] | None
    user: str | None
    tools: list[dict]
    tool_choice: str | dict | None
    parallel_tool_calls: bool | None
    template_kwargs: dict | None
    service_tier: str | None
    reasoning_effort: str | None
    response_format: dict | None
    extensions: dict

    @classmethod
    def parse(cls, body: object, counting: bool = False) -> MessagesRequest:
        """Raises RequestError (an HTTP 400) naming the first field that is wrong; `counting`: a
        count_tokens body."""
        fields, extensions = (COMMON_FIELDS, COUNT_EXTENSIONS) if counting else (MESSAGES_FIELDS, SHOAL_EXTENSIONS)
        body = known_fields(body, {*fields, *extensions})
        model = body["model"]
        max_tokens = _positive(body, "max_tokens")
        if max_tokens is None and not counting:
            raise RequestError("`max_tokens` is required", "max_tokens")
        check_cache_control(body.get("cache_control"), "cache_control")
        turns = chat_messages(body.get("messages"))
        tools = _tools(body)
        tool_choice, parallel_tool_calls = _tool_choice(body, tools)
        reasoning_effort, response_format = _output_config(body)
        tier = typed_field(body, "service_tier", str, "auto or standard_only")
        if tier is not None and tier not in SERVICE_TIERS:
            raise RequestError("`service_tier` must be auto or standard_only", "service_tier")
        return cls(
            model=model,
            messages=system_messages(body.get("system")) + turns,
            prefill=body["messages"][-1]["role"] == "assistant",
            max_tokens=max_tokens,
            stream=typed_field(body, "stream", bool, "a boolean", False),
            temperature=number_in_range(body, "temperature", 0.0, 1.0),
            top_p=number_in_range(body, "top_p", 0.0, 1.0),
            top_k=_positive(body, "top_k"),
            stop=_stop(body),
            user=_user(body),
            tools=tools,
            tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls,
            template_kwargs=_template_kwargs(body, _enable_thinking(body, max_tokens)),
            service_tier=SERVICE_TIERS.get(tier),
            reasoning_effort=reasoning_effort,
            response_format=response_format,
            extensions={k: body[k] for k in extensions if k in body and k != "chat_template_kwargs"},
        )

    def chat_body(self) -> dict:
        """The chat completion request; only the settings the client gave are sent."""
        optional = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "stop": self.stop,
            "user": self.user,
            "tools": self.tools or None,
            "tool_choice": self.tool_choice,
            "parallel_tool_calls": self.parallel_tool_calls,
            "chat_template_kwargs": self.template_kwargs,
            "service_tier": self.service_tier,
            "reasoning_effort": self.reasoning_effort,
            "response_format": self.response_format,
        }
        body = {
            **self.extensions,
            "model": self.model,
            "messages": self.messages,
            "stream": self.stream,
            **{name: value for name, value in optional.items() if value is not None},
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.prefill:
            body.update(add_generation_prompt=False, continue_final_message=True)
        return body

    def count_body(self) -> dict:
        """The one-token chat request whose usage.prompt_tokens is this request's input tokens (an
        output format does not change the prompt, so none is compiled for it)."""
        return {key: value for key, value in self.chat_body().items() if key != "response_format"} | {"max_tokens": 1}
