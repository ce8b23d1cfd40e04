"""A chat request's tools as this worker serves them: which functions the model may call, whether a
call is forced (by a grammar), the model's call format, and the parser that reads its calls.

`tool_choice`: "auto" (the default with tools) lets the model answer or call; "required" forces at
least one call to any tool, a named function forces a call to that one; "none" (the default
without tools) leaves the tools out of the prompt and reads no calls, as vLLM does with
`--exclude-tools-when-tool-choice-none`. `parallel_tool_calls: false` allows one call at most.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from shoal.engine.structured_outputs import StructuredOutputs
from shoal.errors import InvalidRequestError
from shoal.model.tokenizer import Tokenizer
from shoal.worker.protocol import ChatCompletionRequest
from shoal.worker.tool_call_format import HARMONY, HarmonyCallFormat, ToolCallFormat, format_for_template
from shoal.worker.tool_call_parser import ToolCallParser


@dataclass(frozen=True)
class ToolUse:
    """Invariant: `functions` is non-empty and holds the functions the model may call now (just
    the named one when tool_choice names one); `tools` all of the request's tools, for the prompt."""

    tools: list[dict]
    functions: list[dict]
    forced: bool
    parallel: bool
    format: ToolCallFormat | HarmonyCallFormat

    @classmethod
    def of(cls, body: ChatCompletionRequest, tokenizer: Tokenizer, harmony: bool = False) -> ToolUse | None:
        """None when the request reads no tool calls (no tools, or tool_choice "none"). Raises
        InvalidRequestError for a tool_choice that does not fit the tools. `harmony`: the model
        writes harmony (its family says so), whose calls are its own format."""
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []]
        choice = body.tool_choice or ("auto" if tools else "none")
        if choice == "none":
            return None
        if not tools:
            raise InvalidRequestError("tool_choice needs `tools`", param="tool_choice")
        names = [tool["function"]["name"] for tool in tools]
        if len(set(names)) != len(names):
            raise InvalidRequestError("tool function names must be unique", param="tools")
        if isinstance(choice, str):
            functions = [tool["function"] for tool in tools]
        else:
            wanted = choice.function.name
            if wanted not in names:
                raise InvalidRequestError(f"tool_choice names {wanted!r}, which is not in `tools`", "tool_choice")
            functions = [tool["function"] for tool in tools if tool["function"]["name"] == wanted]
        return cls(
            tools=tools,
            functions=functions,
            forced=choice != "auto",
            parallel=body.parallel_tool_calls,
            format=HARMONY if harmony else format_for_template(tokenizer.chat_template_for_tools()),
        )

    def constraint(self, tokenizer: Tokenizer) -> StructuredOutputs | None:
        """The grammar that forces the call, when one is forced."""
        if not self.forced:
            return None

        def special_token_id(text: str) -> int | None:
            ids = tokenizer.encode(text, add_special_tokens=False)
            return ids[0] if len(ids) == 1 else None

        grammar = self.format.forced_grammar(self.functions, self.parallel, special_token_id)
        return StructuredOutputs(grammar=grammar, param="tool_choice")

    @property
    def skip_special_tokens(self) -> bool:
        """False where the call marker is a special token, which the parser must see."""
        return not self.format.start_is_special_token

    def parser(self) -> ToolCallParser:
        """The parser of a JSON call format (a harmony model's calls are read by HarmonyParser)."""
        return ToolCallParser(self.format)


def call_id(seed: int, prompt_token_ids: list[int], index: int) -> str:
    """A call's id: the same for the same request (prompt and seed) wherever it runs, so a stream
    resumed on another worker names its calls as the first worker would have."""
    digest = hashlib.sha256(f"{seed}:{index}:{','.join(map(str, prompt_token_ids))}".encode()).hexdigest()
    return f"call_{digest[:24]}"
