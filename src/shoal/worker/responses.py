"""Completion and chat completion responses from engine streams: one JSON body, or server-sent
events. Every choice carries its token ids and seed, so a router can resume the request elsewhere
(prompt + token ids, same seed); a finished choice carries its `stop_reason` (as vLLM's: the stop
string or stop token id that ended it, else null), which tells which stop sequence matched. A
stream whose request asked for keep-alives (a router's) gets one after KEEP_ALIVE_S with nothing to
send: a comment saying what the engine is busy with, so a router tells a long step from a hung
worker."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from shoal.engine.async_engine import AsyncLLMEngine, Resume
from shoal.engine.outputs import CompletionOutput, RequestOutput
from shoal.engine.structured_outputs import StructuredOutputs
from shoal.errors import InvalidRequestError, PromptTooLongError, ShoalError
from shoal.model.tokenizer import IncrementalDetokenizer
from shoal.protocol.keep_alive import KeepAlive
from shoal.protocol.kv_handoff import Handoff, handoff_event
from shoal.protocol.sse import DONE, data_event
from shoal.worker.chat_choice import ChatChoice
from shoal.worker.logprobs import LogprobRenderer
from shoal.worker.protocol import SamplingFields
from shoal.worker.request_tracing import WorkerRequestSpan
from shoal.worker.served_request import ServedRequest
from shoal.worker.tool_calling import ToolUse

KEEP_ALIVE_S = 0.5


async def respond(engine: AsyncLLMEngine, request: ServedRequest):
    """Runs the request's body.n choices; raises InvalidRequestError (400) or EngineRequestError
    (500) before anything is sent, so a broken request never turns into a broken stream."""
    try:
        response = await _respond(engine, request)
    except BaseException as exc:
        request.trace.end(f"{type(exc).__name__}: {exc}")
        raise
    if not isinstance(response, StreamingResponse):
        request.trace.end()
    return response


async def _respond(engine: AsyncLLMEngine, request: ServedRequest):
    body, prompt_ids, chat, trace = request.body, request.prompt_ids, request.chat, request.trace
    max_tokens, logprobs, predicted = request.max_tokens, request.logprobs, request.predicted
    tool_use, reasoning, kv, max_model_len = request.tool_use, request.reasoning, request.kv, request.max_model_len
    request_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
    room = max_model_len - len(prompt_ids)
    if max_tokens is not None and max_tokens > room:
        raise PromptTooLongError(
            f"max_tokens={max_tokens} does not fit: the prompt has {len(prompt_ids)} tokens "
            f"and the context window {max_model_len}",
            param="max_tokens",
        )
    max_tokens = max_tokens or max(1, room)
    resume = None
    if body.resume_token_ids is not None:
        if body.n != 1:
            raise InvalidRequestError("resume_token_ids needs n=1", param="resume_token_ids")
        resume = Resume(body.resume_token_ids, body.resume_text_offset)
    constraint = _constraint(engine, body, tool_use)
    if constraint is not None:
        await engine.compile_grammar(constraint)
    if body.kv_source and kv is not None:
        await kv.import_prefix(engine, body.kv_source, prompt_ids + list(body.resume_token_ids or ()), trace)
    # A parser that reads special tokens (tool calls', reasoning markers) keeps them whatever the request asks.
    skip_special_tokens = (
        body.skip_special_tokens
        and (tool_use is None or tool_use.skip_special_tokens)
        and (reasoning is None or reasoning.skip_special_tokens)
    )
    for i in range(body.n):
        trace.track(f"{request_id}-{i}")
    streams = [
        engine.generate(
            prompt_ids,
            body.sampling_params(
                max_tokens,
                logprobs,
                None if body.seed is None else body.seed + i,
                constraint,
                skip_special_tokens,
                predicted,
            ),
            request_id=f"{request_id}-{i}",
            scheduling=request.scheduling,
            resume=resume,
            lora=request.lora,
        )
        for i in range(body.n)
    ]
    resumed = len(body.resume_token_ids or ())
    try:
        firsts = [await _first(s) for s in streams]
    except BaseException:
        for stream in streams:
            await stream.aclose()
        raise
    meta = {"id": request_id, "created": int(time.time()), "model": request.model_name}
    if body.service_tier is not None:
        meta["service_tier"] = body.served_tier()
    render = LogprobRenderer(engine.engine.tokenizer, logprobs, chat)
    choices = (
        [
            ChatChoice(tool_use, first.seed, prompt_ids, reasoning, skip_special_tokens, body.legacy_functions)
            for first in firsts
        ]
        if chat
        else None
    )
    if body.stream:
        if choices and resume is not None:
            text = _resumed_text(engine, prompt_ids, resume, skip_special_tokens)
            choices[0].replay(text, resume.token_ids)
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(
            _sse(
                engine,
                streams,
                firsts,
                meta,
                choices,
                len(prompt_ids),
                include_usage,
                render,
                resumed,
                trace,
                request.handoff,
                KEEP_ALIVE_S if request.keep_alive else None,
                bool(predicted),
            ),
            media_type="text/event-stream",
            background=BackgroundTask(trace.end),
        )
    finals = await asyncio.gather(*(_last(s, f) for s, f in zip(streams, firsts)))
    return _full_response(finals, meta, choices, len(prompt_ids), render, bool(predicted))


def _constraint(engine: AsyncLLMEngine, body: SamplingFields, tool_use: ToolUse | None) -> StructuredOutputs | None:
    """What the output must match: the request's own constraint, or the grammar of a forced tool
    call (not both)."""
    own = body.output_constraint()
    forced = tool_use.constraint(engine.engine.tokenizer) if tool_use is not None else None
    if own is not None and forced is not None:
        raise InvalidRequestError(
            "a forced tool call cannot also follow response_format or structured_outputs", param="tool_choice"
        )
    return own or forced


def _resumed_text(engine: AsyncLLMEngine, prompt_ids: list[int], resume: Resume, skip_special_tokens: bool) -> str:
    """The text of the resumed tokens the client already has (the engine decodes them the same way)."""
    detokenizer = IncrementalDetokenizer(engine.engine.tokenizer, prompt_ids, skip_special_tokens)
    text = "".join(detokenizer.add(token) for token in resume.token_ids)
    return text if resume.text_offset is None else text[: resume.text_offset]


async def _first(stream: AsyncIterator[RequestOutput]) -> RequestOutput:
    return await stream.__anext__()


async def _last(stream: AsyncIterator[RequestOutput], first: RequestOutput) -> RequestOutput:
    last = first
    async for output in stream:
        last = output
    return last


def _usage(
    prompt_tokens: int,
    completion_tokens: int,
    chats: list[ChatChoice] | None = None,
    predicted: list[CompletionOutput] | None = None,
) -> dict:
    """With chat choices that split reasoning off, their reasoning tokens too (OpenAI's
    completion_tokens_details.reasoning_tokens); with the choices' last outputs of a request that
    gave a predicted output, its tokens kept and refused as drafts (accepted_prediction_tokens,
    rejected_prediction_tokens)."""
    usage = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    details = {}
    counts = [chat.reasoning_tokens() for chat in chats or ()]
    if any(count is not None for count in counts):
        details["reasoning_tokens"] = sum(count or 0 for count in counts)
    if predicted is not None:
        details["accepted_prediction_tokens"] = sum(out.kept_drafts for out in predicted)
        details["rejected_prediction_tokens"] = sum(out.refused_drafts for out in predicted)
    if details:
        usage["completion_tokens_details"] = details
    return usage


def _full_response(
    finals: list[RequestOutput],
    meta: dict,
    chats: list[ChatChoice] | None,
    prompt_tokens: int,
    render: LogprobRenderer,
    predicted: bool = False,
) -> dict:
    """chats: each choice's message shaper for a chat completion; None for a text completion;
    `predicted`: the request gave a predicted output (its drafts are counted in usage)."""
    choices = []
    for index, final in enumerate(finals):
        out = final.outputs[0]
        choice = {
            "index": index,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
            "token_ids": out.token_ids,
            "seed": final.seed,
        }
        choice["logprobs"] = render(out.token_ids, out.logprobs)
        if chats:
            chats[index].tokens(out.token_ids)
            choice["message"] = chats[index].message(out.text)
            choice["finish_reason"] = chats[index].finish_reason(out.finish_reason)
        else:
            choice["text"] = out.text
        choices.append(choice)
    completion_tokens = sum(len(f.outputs[0].token_ids) for f in finals)
    return {
        **meta,
        "object": "chat.completion" if chats else "text_completion",
        "choices": choices,
        "usage": _usage(prompt_tokens, completion_tokens, chats, [f.outputs[0] for f in finals] if predicted else None),
    }


async def _sse(
    engine: AsyncLLMEngine,
    streams,
    firsts,
    meta: dict,
    chats: list[ChatChoice] | None,
    prompt_tokens: int,
    include_usage: bool,
    render: LogprobRenderer,
    resumed: int,
    trace: WorkerRequestSpan,
    handoff: Callable[[int], Handoff | None] | None = None,
    keep_alive_s: float | None = None,
    predicted: bool = False,
):
    """Merges the choices' outputs into SSE chunks, with a keep-alive after every keep_alive_s
    without one (None: none); abandoning it (client gone) aborts every choice. Usage counts the `resumed`
    tokens too: the client's completion includes them. A chat chunk whose text was read for tool
    calls or split into reasoning and content says how many characters of raw text it stands for
    (`text_chars`), which is what a router resumes from. A one-choice stream with `handoff` asks
    it, after each chunk and keep-alive, whether to end with a handoff event instead (given the
    tokens sent so far); its engine request is then aborted."""
    chat = chats is not None
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream, first: RequestOutput) -> None:
        await queue.put((index, first))
        try:
            async for output in stream:
                await queue.put((index, output))
        except ShoalError as exc:  # the engine failed it, or its grammar ran into a dead end
            await queue.put((index, exc))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
    kind = "chat.completion.chunk" if chat else "text_completion"
    completion_tokens = resumed
    latest = [first.outputs[0] for first in firsts]  # each choice's output so far
    try:
        if chat:
            for index in range(len(streams)):
                yield data_event(
                    {
                        **meta,
                        "object": kind,
                        "choices": [
                            {"index": index, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
                        ],
                    }
                )
        remaining = len(streams)
        while remaining:
            try:
                index, output = await asyncio.wait_for(queue.get(), keep_alive_s)
            except TimeoutError:
                yield _keep_alive(engine)
                if handoff and (moved := handoff(completion_tokens - resumed)):
                    yield handoff_event(moved)
                    return
                continue
            if output is None:
                remaining -= 1
                continue
            if isinstance(output, ShoalError):
                yield data_event(output.body())
                continue
            completion_tokens += len(output.new_token_ids)
            latest[index] = output.outputs[0]
            finish_reason = output.outputs[0].finish_reason if output.finished else None
            choice = {
                "index": index,
                "finish_reason": chats[index].finish_reason(finish_reason) if chat else finish_reason,
                "token_ids": output.new_token_ids,
                "seed": output.seed,
            }
            new = len(output.new_token_ids)
            entries = output.outputs[0].logprobs
            choice["logprobs"] = render(output.new_token_ids, entries[len(entries) - new :] if entries else None)
            if chat:
                chats[index].tokens(output.new_token_ids)
                choice["delta"] = chats[index].delta(output.new_text, output.finished)
                if chats[index].parses_text:
                    choice["text_chars"] = len(output.new_text)
            else:
                choice["text"] = output.new_text
            if output.finished:
                choice["stop_reason"] = output.outputs[0].stop_reason
            yield data_event({**meta, "object": kind, "choices": [choice]})
            if handoff and not output.finished and (moved := handoff(completion_tokens - resumed)):
                yield handoff_event(moved)
                return
        if include_usage:
            usage = _usage(prompt_tokens, completion_tokens, chats, latest if predicted else None)
            yield data_event({**meta, "object": kind, "choices": [], "usage": usage})
        yield DONE
    finally:
        for task in tasks:
            task.cancel()
        # A pump may be inside its stream; it must have left before the stream can be closed.
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()
        trace.end()


def _keep_alive(engine: AsyncLLMEngine) -> bytes:
    activity = engine.activity()
    step_s = None if activity.step_s is None else round(activity.step_s, 3)
    return KeepAlive(busy_s=round(activity.busy_s, 3), step_s=step_s).encode()
