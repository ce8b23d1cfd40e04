"""The prompt text of a chat request, rendered by the model's own chat template.

Tools go through the template's tools section where it has one; assistant tool calls and tool
results reach such a template as messages of their own (even in a request without tools), the
calls' arguments as objects (as Hugging Face templates expect). A template without a tools section
gets DEFAULT_TOOLS_PROMPT in the system message, assistant tool calls written in the Hermes format
in the assistant's text, and tool results as user turns wrapped in <tool_response> tags. An
assistant message's reasoning_content reaches the template as it is (Qwen3's and harmony's render
it), and so do the request's chat_template_kwargs, its reasoning_effort and its verbosity (as
variables of those names; logged as unused where the template does not read them); a template that refuses
the conversation (its `raise_exception`) or fails on it is the request's fault, a 400.
"""

from __future__ import annotations

import json
import logging

from shoal.errors import InvalidRequestError
from shoal.model.errors import ChatTemplateError
from shoal.model.tokenizer import Tokenizer
from shoal.worker.protocol import ChatCompletionRequest, ChatMessage
from shoal.worker.tool_call_format import template_renders_tools
from shoal.worker.tool_calling import ToolUse

logger = logging.getLogger(__name__)

DEFAULT_TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


def chat_prompt(tokenizer: Tokenizer, body: ChatCompletionRequest, tool_use: ToolUse | None) -> str:
    template = tokenizer.chat_template_for_tools() if tool_use is not None else tokenizer.chat_template
    native = template_renders_tools(template)
    messages = [_template_message(m, native) for m in body.messages]
    if tool_use is not None and not native:
        messages = _with_tools_prompt(messages, tool_use.tools)
    try:
        return tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            tools=tool_use.tools if tool_use is not None and native else None,
            continue_final_message=body.continue_final_message,
            template_kwargs=_template_kwargs(body, template),
        )
    except ChatTemplateError as exc:
        raise InvalidRequestError(f"the chat template refused the request: {exc}") from None


# Request fields that reach the chat template as variables of the same name.
TEMPLATE_FIELDS = ("reasoning_effort", "verbosity")


def _template_kwargs(body: ChatCompletionRequest, template: str | None) -> dict | None:
    """The request's chat_template_kwargs, with its reasoning_effort and verbosity (each given once,
    as the field or in chat_template_kwargs, not both)."""
    kwargs = dict(body.chat_template_kwargs or {})
    for name in TEMPLATE_FIELDS:
        value = getattr(body, name)
        if value is None:
            continue
        if name in kwargs:
            raise InvalidRequestError(f"give {name} as the field or in chat_template_kwargs, not both", param=name)
        if name not in (template or ""):
            logger.info("%s %r is unused: this model's chat template does not read it", name, value)
        kwargs[name] = value
    return kwargs if body.chat_template_kwargs is not None or kwargs else None


def _template_message(message: ChatMessage, native: bool) -> dict:
    rendered = _message_fields(message, native)
    if message.reasoning_content is not None:
        rendered["reasoning_content"] = message.reasoning_content
    return rendered


def _message_fields(message: ChatMessage, native: bool) -> dict:
    text = message.text()
    if not native and message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    if not native and message.tool_calls:
        blocks = [
            "<tool_call>\n"
            + json.dumps({"name": call.function.name, "arguments": _arguments(call.function.arguments)})
            + "\n</tool_call>"
            for call in message.tool_calls
        ]
        return {"role": "assistant", "content": "\n".join([text, *blocks] if text else blocks)}
    rendered = {"role": message.role, "content": text}
    if message.name is not None:
        rendered["name"] = message.name
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        rendered["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in message.tool_calls
        ]
    return rendered


def _arguments(text: str) -> object:
    try:
        return json.loads(text)
    except ValueError:
        raise InvalidRequestError(
            f"a tool call's arguments must be JSON text, got {text[:80]!r}", param="messages"
        ) from None


def _with_tools_prompt(messages: list[dict], tools: list[dict]) -> list[dict]:
    """The tools prompt after the system message's own text, or as a system message of its own."""
    prompt = DEFAULT_TOOLS_PROMPT.format(tools="\n".join(json.dumps(tool) for tool in tools))
    if messages and messages[0]["role"] in ("system", "developer"):
        first = messages[0]
        return [{**first, "content": f"{first['content']}\n\n{prompt}" if first["content"] else prompt}, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]
