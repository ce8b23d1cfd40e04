"""How a model writes tool calls, chosen from its chat template, and the grammar that forces a call.

- `hermes`: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, one block per call
  (Hermes, Qwen 2.5 and 3, and the default for templates without a tools section);
- `llama3_json`: a bare `{"name": ..., "parameters": {...}}` that opens the reply (Llama 3.1+);
- `mistral`: `[TOOL_CALLS]` then a JSON array of `{"name": ..., "arguments": {...}}`;
- `harmony` (gpt-oss, chosen by its family, not its template): a commentary message to the function,
  `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}`, read by HarmonyParser.

A forced call (`tool_choice` "required" or a named function) is a Lark grammar whose call bodies are
llguidance `%json` schemas: the name is one of the allowed functions and the arguments match that
function's parameter schema, written as json.dumps writes JSON.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shoal.worker.harmony_parser import CHANNEL, CONSTRAIN, FUNCTIONS, MESSAGE

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# gpt-oss writes its call arguments without spaces.
COMPACT_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}


@dataclass(frozen=True)
class ToolCallFormat:
    """Invariant: `start` opens every call block (or the array of calls), and where it is None a
    bare JSON object opening the reply is a call; `end` closes one block where the format has one;
    a call body is a JSON object with the name under "name" and the arguments under
    `arguments_key`."""

    name: str
    start: str | None
    end: str | None
    arguments_key: str
    calls_in_array: bool = False
    start_is_special_token: bool = False

    def forced_grammar(
        self, functions: Sequence[dict], parallel: bool, special_token_id: Callable[[str], int | None]
    ) -> str:
        """A Lark grammar whose every sentence is one call (or, with `parallel`, one or more) to
        one of `functions` (OpenAI function definitions), in this format."""
        call = (
            {"anyOf": [self._call_schema(f) for f in functions]}
            if len(functions) > 1
            else self._call_schema(functions[0])
        )
        start = self._start_terminal(special_token_id)
        if self.calls_in_array:
            calls = {"type": "array", "items": call, "minItems": 1, "x-guidance": JSON_STYLE}
            if not parallel:
                calls["maxItems"] = 1
            return f"start: {start} calls\ncalls: %json {json.dumps(calls)}\n"
        call = {**call, "x-guidance": JSON_STYLE}
        if self.start is None:  # a bare JSON object opens the reply; calls are separated by "; "
            block, separator = "body", '"; "'
        else:
            block = f'{start} body "\\n{self.end}"' if self.end else f"{start} body"
            separator = '"\\n"'
        repeat = f"block ({separator} block)*" if parallel else "block"
        return f"start: {repeat}\nblock: {block}\nbody: %json {json.dumps(call)}\n"

    def _start_terminal(self, special_token_id: Callable[[str], int | None]) -> str:
        if not self.start:
            return ""
        if self.start_is_special_token:
            return _marker_terminal(self.start, special_token_id)
        return json.dumps(self.start + ("\n" if self.end else ""))

    def _call_schema(self, function: dict) -> dict:
        parameters = function.get("parameters") or {"type": "object", "properties": {}}
        return {
            "type": "object",
            "properties": {"name": {"const": function["name"]}, self.arguments_key: parameters},
            "required": ["name", self.arguments_key],
            "additionalProperties": False,
        }


@dataclass(frozen=True)
class HarmonyCallFormat:
    """Invariant: a harmony call is one commentary message to `functions.NAME`, whose body is the
    arguments as JSON; the message ends the generation (`<|call|>`), so a turn makes one call."""

    name: str = "harmony"
    start_is_special_token: bool = True

    def forced_grammar(
        self, functions: Sequence[dict], parallel: bool, special_token_id: Callable[[str], int | None]
    ) -> str:
        """A Lark grammar whose every sentence is one call message to one of `functions` (after
        the generation prompt's `<|start|>assistant`), whatever `parallel` says."""
        channel, constrain, message = (_marker_terminal(m, special_token_id) for m in (CHANNEL, CONSTRAIN, MESSAGE))
        rules = [f"start: {' | '.join(f'call{i}' for i in range(len(functions)))}"]
        for i, function in enumerate(functions):
            header = json.dumps(f"commentary to={FUNCTIONS}{function['name']} ")
            parameters = function.get("parameters") or {"type": "object", "properties": {}}
            rules.append(f'call{i}: {channel} {header} {constrain} "json" {message} arguments{i}')
            rules.append(f"arguments{i}: %json {json.dumps({**parameters, 'x-guidance': COMPACT_JSON_STYLE})}")
        return "\n".join(rules) + "\n"


def _marker_terminal(marker: str, special_token_id: Callable[[str], int | None]) -> str:
    """A marker as a Lark terminal: its special token where it is one, else its text."""
    token = special_token_id(marker)
    return f"<[{token}]>" if token is not None else json.dumps(marker)


HARMONY = HarmonyCallFormat()
HERMES = ToolCallFormat("hermes", "<tool_call>", "</tool_call>", "arguments")
LLAMA3_JSON = ToolCallFormat("llama3_json", None, None, "parameters")  # no start: a bare JSON object opens
MISTRAL = ToolCallFormat("mistral", "[TOOL_CALLS]", None, "arguments", calls_in_array=True, start_is_special_token=True)


def format_for_template(template: str | None) -> ToolCallFormat:
    """The format a chat template teaches its model; Hermes where the template shows none."""
    source = template or ""
    if "[TOOL_CALLS]" in source:
        return MISTRAL
    if "<tool_call>" in source:
        return HERMES
    if "<|python_tag|>" in source or "ipython" in source:
        return LLAMA3_JSON
    return HERMES


def template_renders_tools(template: str | None) -> bool:
    """Whether the template has a tools section of its own (it reads the `tools` variable)."""
    return bool(template) and "tools" in template
