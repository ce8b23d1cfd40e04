"""How a stream broken after its first output continues on another worker, by the engine it goes to.

- **Token-exact**: a shoal worker takes the token ids relayed so far (`resume_token_ids`) and the
  same seed: the client gets the tokens an unbroken run would have given. Token ids come from shoal
  workers, and from vLLM, which the router asks for them (`return_token_ids`).
- **Text, chat**: an engine that takes `continue_final_message` (shoal, vLLM, SGLang) gets the
  conversation with the text relayed so far as an open assistant message.
- **Text, completions**: any engine gets a text prompt followed by the text relayed so far; an
  engine that takes token-id prompts (shoal, vLLM, SGLang) gets a token-id prompt followed by the
  token ids, where they are known.

A text continuation sends the client no text twice and leaves none out, but it is not the output an
unbroken run would have given: the engine re-tokenizes the text so far (the seam may split into other
tokens) and samples with its own random state. `max_tokens` and `min_tokens` shrink by the tokens
relayed (counted as chunks where the engine sends no ids). A request whose output is constrained
(`response_format`, `structured_outputs`, tools) or which streamed tool calls continues only
token-exact: a grammar restarted after a text prefix would not know where it stands. So does one
that streamed reasoning deltas: the raw text they were split from (markers and all) is not known
here, so no text prefix can stand for it.
llama.cpp's server (llama-cpp-python) takes neither an assistant prefix in chat nor token-id prompts,
so its chat streams continue elsewhere; it takes fresh requests and text completions' continuations.
"""

from __future__ import annotations

from shoal.router.streams.relay import StreamProgress

TOKEN_RESUMING_ENGINES = frozenset({"shoal"})
CHAT_CONTINUING_ENGINES = frozenset({"shoal", "vllm", "sglang"})
TOKEN_PROMPT_ENGINES = frozenset({"shoal", "vllm", "sglang"})
# Fields that make an engine stream the token ids of its output (shoal's workers always do).
TOKEN_ID_FIELDS = {"vllm": {"return_token_ids": True}}
CONSTRAINING_FIELDS = ("response_format", "structured_outputs", "tools", "guided_json", "guided_regex")


def by_tokens(engine: str | None, progress: StreamProgress) -> bool:
    """Whether a worker of `engine` continues this stream token-exact."""
    return engine in TOKEN_RESUMING_ENGINES and bool(progress.token_ids)


def can_continue(engine: str | None, progress: StreamProgress, body: dict, chat: bool) -> bool:
    """Whether a worker of `engine` (None: unknown) can continue this stream at all."""
    if by_tokens(engine, progress):
        return True
    if progress.tool_calls or progress.reasoning or any(_constrains(body.get(name)) for name in CONSTRAINING_FIELDS):
        return False
    if chat:
        return engine in CHAT_CONTINUING_ENGINES
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return True
    return engine in TOKEN_PROMPT_ENGINES and _is_token_ids(prompt) and len(progress.token_ids) == progress.tokens


def continuation_body(body: dict, progress: StreamProgress, engine: str | None, chat: bool) -> dict:
    """The request that continues the stream on a worker of `engine` (can_continue holds)."""
    if by_tokens(engine, progress):
        return progress.resume_body(body)
    left = {
        key: max(1, body[key] - progress.tokens) for key in ("max_tokens", "max_completion_tokens") if _int(body, key)
    }
    if _int(body, "min_tokens"):
        left["min_tokens"] = max(0, body["min_tokens"] - progress.tokens)
    if chat:
        return {
            **body,
            **left,
            "messages": _with_assistant_text(body["messages"], progress.text, body.get("continue_final_message")),
            "continue_final_message": True,
            "add_generation_prompt": False,
        }
    prompt = body["prompt"]
    prompt = prompt + progress.text if isinstance(prompt, str) else prompt + progress.token_ids
    return {**body, **left, "prompt": prompt, "echo": False}


def with_token_ids_asked(body: dict, engine: str | None) -> dict:
    """`body` with the fields that make `engine` stream its output's token ids, if it needs any."""
    fields = TOKEN_ID_FIELDS.get(engine or "")
    return {**body, **fields} if fields else body


def _with_assistant_text(messages: list, text: str, continuing: object) -> list:
    """The messages with `text` appended to the open assistant message (the client's own, when it
    asked for continue_final_message), or as a new one."""
    if not continuing:
        return [*messages, {"role": "assistant", "content": text}]
    last = messages[-1]
    content = last.get("content")
    if isinstance(content, list):
        content = [*content, {"type": "text", "text": text}]
    else:
        content = (content or "") + text
    return [*messages[:-1], {**last, "content": content}]


def _constrains(value: object) -> bool:
    if isinstance(value, dict):
        return value.get("type", "json_object") != "text"
    return bool(value)


def _int(body: dict, key: str) -> bool:
    return isinstance(body.get(key), int) and not isinstance(body.get(key), bool)


def _is_token_ids(prompt: object) -> bool:
    return isinstance(prompt, list) and bool(prompt) and all(isinstance(t, int) for t in prompt)
