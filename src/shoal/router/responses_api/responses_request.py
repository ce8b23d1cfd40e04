"""A `POST /v1/responses` body, validated, and the chat completion request it becomes."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.router.body_fields import known_fields, metadata_field, number_in_range, typed_field
from shoal.router.placement.route_request import RequestError
from shoal.router.responses_api.input_items import normalize_input

# Fields of shoal's workers' chat requests that a Responses request may carry; they are passed
# through to the chat request unchanged (the worker validates them).
SHOAL_EXTENSIONS = (
    "seed",
    "ignore_eos",
    "stop",
    "top_k",
    "min_p",
    "repetition_penalty",
    "priority",
    "structured_outputs",
    "chat_template_kwargs",
)
RESPONSES_FIELDS = (
    "model",
    "input",
    "instructions",
    "previous_response_id",
    "store",
    "stream",
    "max_output_tokens",
    "temperature",
    "top_p",
    "metadata",
    "user",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "text",
    "reasoning",
    "include",
    "truncation",
    "service_tier",
    "prompt_cache_key",
    "safety_identifier",
    "max_tool_calls",
    "background",
    "top_logprobs",
)
OUTPUT_LOGPROBS = "message.output_text.logprobs"
MAX_TOP_LOGPROBS = 20
SERVICE_TIERS = ("auto", "default", "flex", "priority")
VERBOSITIES = ("low", "medium", "high")
TEXT_FORMATS = ("text", "json_object", "json_schema")
REASONING_EFFORTS = ("low", "medium", "high")


def _output_logprobs(body: dict) -> bool:
    """Whether `include` asks for the output text's logprobs, the one extra it can name here (the
    others concern hosted tools, images and encrypted reasoning, which shoal has none of)."""
    include = typed_field(body, "include", list, "a list of strings", [])
    unknown = [value for value in include if value != OUTPUT_LOGPROBS]
    if unknown:
        raise RequestError(f"`include` value {unknown[0]!r} is not supported", "include")
    return bool(include)


def _top_logprobs(body: dict) -> int | None:
    top = typed_field(body, "top_logprobs", int, f"an integer in [0, {MAX_TOP_LOGPROBS}]")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise RequestError(f"`top_logprobs` must be an integer in [0, {MAX_TOP_LOGPROBS}]", "top_logprobs")
    return top


def _background(body: dict) -> bool:
    """`background`: true runs the response after the request returns (responses_api.background);
    such a response is stored, so `store: false` with it is refused."""
    background = typed_field(body, "background", bool, "a boolean", False)
    if background and body.get("store") is False:
        raise RequestError("a background response is stored: `store` cannot be false with `background`", "background")
    return background


def _max_tool_calls(body: dict) -> int | None:
    """`max_tool_calls` bounds calls to built-in tools, which shoal has none of: any bound holds."""
    bound = typed_field(body, "max_tool_calls", int, "a non-negative integer")
    if bound is not None and bound < 0:
        raise RequestError("`max_tool_calls` must be a non-negative integer", "max_tool_calls")
    return bound


def _truncation(body: dict) -> str:
    """`truncation`: "disabled" (the default: an input over the context is a 400), or "auto" (the
    worker drops items from the middle of the conversation until it fits)."""
    truncation = typed_field(body, "truncation", str, '"auto" or "disabled"', "disabled")
    if truncation not in ("auto", "disabled"):
        raise RequestError('`truncation` must be "auto" or "disabled"', "truncation")
    return truncation


def _choice(body: dict, name: str, choices: tuple[str, ...]) -> str | None:
    value = typed_field(body, name, str, f"one of {', '.join(choices)}")
    if value is not None and value not in choices:
        raise RequestError(f"`{name}` must be one of {', '.join(choices)}", name)
    return value


def _verbosity(body: dict) -> str | None:
    """`text.verbosity` (the chat request's verbosity)."""
    text = typed_field(body, "text", dict, "an object", {})
    verbosity = text.get("verbosity")
    if verbosity is not None and verbosity not in VERBOSITIES:
        raise RequestError(f"`text.verbosity` must be one of {', '.join(VERBOSITIES)}", "text.verbosity")
    return verbosity


def _text_format(body: dict) -> dict:
    """`text.format`: {"type": "text"} (the default), {"type": "json_object"}, or {"type":
    "json_schema", "name", "schema", "strict", "description"}."""
    text = typed_field(body, "text", dict, "an object", {})
    if set(text) - {"format", "verbosity"}:
        raise RequestError(f"`text.{sorted(set(text) - {'format', 'verbosity'})[0]}` is not supported", "text")
    text_format = text.get("format", {"type": "text"})
    if not isinstance(text_format, dict) or text_format.get("type") not in TEXT_FORMATS:
        raise RequestError(f"`text.format.type` must be one of {', '.join(TEXT_FORMATS)}", "text.format.type")
    allowed = {"type"} | (
        {"name", "schema", "strict", "description"} if text_format["type"] == "json_schema" else set()
    )
    unknown = sorted(set(text_format) - allowed)
    if unknown:
        raise RequestError(f"`text.format.{unknown[0]}` is not supported here", f"text.format.{unknown[0]}")
    if text_format["type"] == "json_schema" and not (
        isinstance(text_format.get("name"), str) and isinstance(text_format.get("schema"), dict)
    ):
        raise RequestError("a json_schema format needs a `name` and a `schema` object", "text.format")
    return text_format


def _reasoning_effort(body: dict) -> str | None:
    """`reasoning.effort` (the chat request's reasoning_effort); the object's other fields
    (summaries, which shoal does not write) are refused by name unless null."""
    reasoning = typed_field(body, "reasoning", dict, "an object", {})
    unknown = sorted(name for name, value in reasoning.items() if name != "effort" and value is not None)
    if unknown:
        raise RequestError(f"`reasoning.{unknown[0]}` is not supported", f"reasoning.{unknown[0]}")
    effort = reasoning.get("effort")
    if effort is not None and effort not in REASONING_EFFORTS:
        raise RequestError(f"`reasoning.effort` must be one of {', '.join(REASONING_EFFORTS)}", "reasoning.effort")
    return effort


def _function_tools(body: dict) -> list[dict]:
    """Function tools, in the Responses shape ({"type": "function", "name", "parameters", ...})."""
    tools = typed_field(body, "tools", list, "a list", [])
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise RequestError(f"`{where}.type` {kind!r} is not supported; only function tools are", f"{where}.type")
        unknown = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
        if unknown:
            raise RequestError(f"`{where}.{unknown[0]}` is not supported", f"{where}.{unknown[0]}")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise RequestError(f"`{where}.name` must be a non-empty string", f"{where}.name")
    return tools


def _tool_choice(body: dict, tools: list[dict]) -> str | dict:
    choice = body.get("tool_choice")
    if choice is None:
        return "auto"
    if choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and set(choice) == {"type", "name"}:
        if choice["name"] not in [tool["name"] for tool in tools]:
            raise RequestError(f"`tool_choice` names {choice['name']!r}, which is not in `tools`", "tool_choice")
        return choice
    raise RequestError(
        '`tool_choice` must be "auto", "none", "required" or {"type": "function", "name": ...}', "tool_choice"
    )


@dataclass(frozen=True)
class ResponsesRequest:
    """Invariants: every field has its type and range; `input_items` is non-empty and normalised;
    `extensions` holds only SHOAL_EXTENSIONS. Unknown fields are refused, not ignored."""

    model: str
    input_items: list[dict]
    instructions: str | None
    previous_response_id: str | None
    store: bool
    stream: bool
    background: bool
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    metadata: dict[str, str]
    user: str | None
    tools: list[dict]
    tool_choice: str | dict
    parallel_tool_calls: bool
    text_format: dict
    verbosity: str | None
    reasoning_effort: str | None
    service_tier: str | None
    prompt_cache_key: str | None
    safety_identifier: str | None
    max_tool_calls: int | None
    truncation: str
    output_logprobs: bool
    top_logprobs: int | None
    extensions: dict

    @classmethod
    def parse(cls, body: object) -> ResponsesRequest:
        """Raises RequestError (an HTTP 400) naming the first field that is wrong."""
        body = known_fields(body, {*RESPONSES_FIELDS, *SHOAL_EXTENSIONS})
        model = body["model"]
        max_output_tokens = typed_field(body, "max_output_tokens", int, "a positive integer")
        if max_output_tokens is not None and max_output_tokens < 1:
            raise RequestError("`max_output_tokens` must be a positive integer", "max_output_tokens")
        tools = _function_tools(body)
        return cls(
            model=model,
            input_items=normalize_input(body.get("input")),
            instructions=typed_field(body, "instructions", str, "a string"),
            previous_response_id=typed_field(body, "previous_response_id", str, "a response id"),
            store=typed_field(body, "store", bool, "a boolean", True),
            stream=typed_field(body, "stream", bool, "a boolean", False),
            background=_background(body),
            max_output_tokens=max_output_tokens,
            temperature=number_in_range(body, "temperature", 0.0, 2.0),
            top_p=number_in_range(body, "top_p", 0.0, 1.0, low_open=True),
            metadata=metadata_field(body, {}),
            user=typed_field(body, "user", str, "a string"),
            tools=tools,
            tool_choice=_tool_choice(body, tools),
            parallel_tool_calls=typed_field(body, "parallel_tool_calls", bool, "a boolean", True),
            text_format=_text_format(body),
            verbosity=_verbosity(body),
            reasoning_effort=_reasoning_effort(body),
            service_tier=_choice(body, "service_tier", SERVICE_TIERS),
            prompt_cache_key=typed_field(body, "prompt_cache_key", str, "a string"),
            safety_identifier=typed_field(body, "safety_identifier", str, "a string"),
            max_tool_calls=_max_tool_calls(body),
            truncation=_truncation(body),
            output_logprobs=_output_logprobs(body),
            top_logprobs=_top_logprobs(body),
            extensions={name: body[name] for name in SHOAL_EXTENSIONS if name in body},
        )

    def chat_body(self, messages: list[dict]) -> dict:
        """The chat completion request for `messages`; only the settings the client gave are sent."""
        optional = {
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "user": self.user,
            "reasoning_effort": self.reasoning_effort,
            "verbosity": self.verbosity,
            "service_tier": self.service_tier,
            "prompt_cache_key": self.prompt_cache_key,
            "safety_identifier": self.safety_identifier,
        }
        body = {
            **self.extensions,
            "model": self.model,
            "messages": messages,
            "stream": self.stream,
            **{name: value for name, value in optional.items() if value is not None},
        }
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        if self.output_logprobs:
            body.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        if self.truncation == "auto":
            body["truncation"] = "auto"
        if self.tools:
            body["tools"] = [
                {"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}} for tool in self.tools
            ]
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if self.tools or self.tool_choice != "auto":
            choice = self.tool_choice
            body["tool_choice"] = (
                {"type": "function", "function": {"name": choice["name"]}} if isinstance(choice, dict) else choice
            )
        if self.text_format["type"] == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif self.text_format["type"] == "json_schema":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {k: v for k, v in self.text_format.items() if k != "type"},
            }
        return body
