"""One request as the worker's endpoints prepared it for the engine (shoal.worker.responses)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from shoal.protocol.kv_handoff import Handoff
from shoal.worker.kv_mobility import KVMobility
from shoal.worker.protocol import SamplingFields
from shoal.worker.reasoning_use import ReasoningUse
from shoal.worker.request_tracing import WorkerRequestSpan
from shoal.worker.tool_calling import ToolUse


@dataclass(frozen=True)
class ServedRequest:
    """The body and its prompt ids; `max_tokens` and `logprobs` as the endpoint reads them (None:
    to the context window's end, none); `chat` for a chat completion; the `model_name` it answers
    as and the engine's `max_model_len`; `trace`, its span, which ends with the response. A chat
    request with `tool_use` has its tool calls read from its output, and forced by a grammar where
    tool_choice asks for a call; with `reasoning`, its reasoning section is split off its answer
    and its tokens counted. With `kv`, the KV named by `kv_source` is imported first; a stream is
    handed off when `handoff` (given the tokens sent) says; with `keep_alive` (the request asked
    for them) a silent stream gets keep-alives. `scheduling` is the engine's class for it
    (background for a router's batch work); `predicted`, the token ids of its predicted output
    (drafts for speculative decoding); `lora`, the LoRA adapter it runs."""

    body: SamplingFields
    prompt_ids: list[int]
    max_tokens: int | None
    logprobs: int | None
    chat: bool
    model_name: str
    max_model_len: int
    trace: WorkerRequestSpan
    tool_use: ToolUse | None = None
    kv: KVMobility | None = None
    handoff: Callable[[int], Handoff | None] | None = None
    keep_alive: bool = False
    reasoning: ReasoningUse | None = None
    scheduling: str = "interactive"
    predicted: tuple[int, ...] = ()
    lora: str | None = None
