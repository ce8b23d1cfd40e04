"""Renders a model's own Jinja chat template the way transformers' `apply_chat_template` does.

Templates are untrusted code from model files, so they run in jinja2's immutable sandbox, with
transformers' settings (trim_blocks, lstrip_blocks, loop controls) and helpers (`raise_exception`,
`strftime_now`, a non-HTML-escaping `tojson`, and a pass-through `{% generation %}` block).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shoal.model.errors import ChatTemplateError, ModelLoadError


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it just renders."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


# The variables render_chat_template sets itself.
RENDER_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_chat_template(source: str) -> jinja2.Template:
    """Compiles `source` in a fresh sandboxed environment; syntax errors raise ModelLoadError."""
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as exc:
        raise ModelLoadError(f"chat template does not compile: {exc}") from exc


def render_chat_template(
    template: jinja2.Template,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool,
    tools: Sequence[Mapping[str, Any]] | None,
    special_tokens: Mapping[str, str | None],
    template_kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The prompt text. Like transformers, message keys whose value is None are dropped before rendering,
    special token strings (bos_token, eos_token, ...) are visible to the template, and so are
    `template_kwargs` (a request's chat_template_kwargs, such as Qwen3's `enable_thinking`), which
    may shadow a special token but not the variables set here (RENDER_VARIABLES)."""
    taken = sorted(set(template_kwargs or {}) & set(RENDER_VARIABLES))
    if taken:
        raise ChatTemplateError(f"chat template variable {taken[0]!r} cannot be set by chat_template_kwargs")
    plain = [{key: value for key, value in dict(message).items() if value is not None} for message in messages]
    context = {name: token for name, token in special_tokens.items() if token is not None}
    context.update(template_kwargs or {})
    try:
        return template.render(
            messages=plain,
            tools=list(tools) if tools is not None else None,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **context,
        )
    except jinja2.TemplateError as exc:
        raise ChatTemplateError(str(exc)) from exc
