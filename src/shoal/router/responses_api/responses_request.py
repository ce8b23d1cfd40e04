"""A `POST /v1/responses` body, validated, and the chat completion request it becomes."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.router.responses_api.input_items import normalize_input
from shoal.router.route_request import RequestError

# Sampling fields of shoal's workers that a Responses request may carry; they are passed through
# to the chat request unchanged (the worker validates them).
SHOAL_EXTENSIONS = ("seed", "ignore_eos", "stop", "top_k", "min_p", "repetition_penalty", "priority")
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
)
MAX_METADATA_KEYS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512


def _field(body: dict, name: str, kind: type | tuple[type, ...], description: str, default=None):
    """body[name] when it has the type (null counts as absent); booleans are not numbers here."""
    value = body.get(name)
    if value is None:
        return default
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise RequestError(f"`{name}` must be {description}", name)
    return value


def _number(body: dict, name: str, low: float, high: float, low_open: bool = False) -> float | None:
    value = _field(body, name, (int, float), "a number")
    if value is not None and not (low < value <= high if low_open else low <= value <= high):
        raise RequestError(f"`{name}` must be in {'(' if low_open else '['}{low}, {high}]", name)
    return value


def _metadata(body: dict) -> dict[str, str]:
    metadata = _field(body, "metadata", dict, "an object of string values", {})
    if len(metadata) > MAX_METADATA_KEYS or not all(
        isinstance(v, str) and len(k) <= MAX_METADATA_KEY_CHARS and len(v) <= MAX_METADATA_VALUE_CHARS
        for k, v in metadata.items()
    ):
        raise RequestError(
            f"`metadata` takes at most {MAX_METADATA_KEYS} keys of up to {MAX_METADATA_KEY_CHARS} "
            f"characters with string values of up to {MAX_METADATA_VALUE_CHARS}",
            "metadata",
        )
    return metadata


def _check_text_only(body: dict) -> None:
    """Tools and structured output are not served: accepted only at their plain-text defaults."""
    if _field(body, "tools", list, "a list", []):
        raise RequestError("`tools` are not supported by this server", "tools")
    text = _field(body, "text", dict, "an object", {})
    if set(text) - {"format"} or text.get("format", {"type": "text"}) != {"type": "text"}:
        raise RequestError(
            'only plain text output is supported: `text` may only be {"format": {"type": "text"}}', "text"
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
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    metadata: dict[str, str]
    user: str | None
    tool_choice: str
    parallel_tool_calls: bool
    extensions: dict

    @classmethod
    def parse(cls, body: object) -> ResponsesRequest:
        """Raises RequestError (an HTTP 400) naming the first field that is wrong."""
        if not isinstance(body, dict):
            raise RequestError("the body must be a JSON object")
        unknown = sorted(set(body) - set(RESPONSES_FIELDS) - set(SHOAL_EXTENSIONS))
        if unknown:
            raise RequestError(f"unknown or unsupported parameter `{unknown[0]}`", unknown[0])
        model = _field(body, "model", str, "a non-empty string", "")
        if not model:
            raise RequestError("`model` is required and must be a non-empty string", "model")
        max_output_tokens = _field(body, "max_output_tokens", int, "a positive integer")
        if max_output_tokens is not None and max_output_tokens < 1:
            raise RequestError("`max_output_tokens` must be a positive integer", "max_output_tokens")
        tool_choice = _field(body, "tool_choice", str, '"auto" or "none"', "auto")
        if tool_choice not in ("auto", "none"):
            raise RequestError('`tool_choice` must be "auto" or "none" (tools are not supported)', "tool_choice")
        _check_text_only(body)
        return cls(
            model=model,
            input_items=normalize_input(body.get("input")),
            instructions=_field(body, "instructions", str, "a string"),
            previous_response_id=_field(body, "previous_response_id", str, "a response id"),
            store=_field(body, "store", bool, "a boolean", True),
            stream=_field(body, "stream", bool, "a boolean", False),
            max_output_tokens=max_output_tokens,
            temperature=_number(body, "temperature", 0.0, 2.0),
            top_p=_number(body, "top_p", 0.0, 1.0, low_open=True),
            metadata=_metadata(body),
            user=_field(body, "user", str, "a string"),
            tool_choice=tool_choice,
            parallel_tool_calls=_field(body, "parallel_tool_calls", bool, "a boolean", True),
            extensions={name: body[name] for name in SHOAL_EXTENSIONS if name in body},
        )

    def chat_body(self, messages: list[dict]) -> dict:
        """The chat completion request for `messages`; only the settings the client gave are sent."""
        optional = {
            "max_tokens": self.max_output_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "user": self.user,
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
        return body
