"""Async front of the engine: submit, stream tokens, abort. The engine runs in its own thread.

All engine state is touched by that thread only; callers talk to it through a command queue and get
outputs through per-request asyncio queues, so a slow step never blocks the caller's event loop.
Other threads read the engine's figures from `stats`, a snapshot the engine thread republishes after
every command and step.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from shoal.engine.engine import EngineStats, LLMEngine
from shoal.engine.kv_transfer import KVBlocks
from shoal.engine.outputs import RequestOutput
from shoal.engine.sampling_params import SamplingParams
from shoal.engine.structured_outputs import StructuredOutputs

log = logging.getLogger(__name__)

# Longer than a tensor-parallel collective may wait, so a step stuck in one has ended by then.
SHUTDOWN_WAIT_S = 90.0


@dataclass(frozen=True)
class Resume:
    """Continue a request another engine started: its output tokens so far, and how much of their
    text the client already received (None: all of it)."""

    token_ids: list[int]
    text_offset: int | None = None


@dataclass(frozen=True)
class EngineActivity:
    """What the engine thread is on: for how many seconds it has been on its current step or
    command, and how long that step should take (None outside a step, or while the engine does
    not know its speed yet). A stuck or dead engine thread shows as busy_s growing past step_s."""

    busy_s: float
    step_s: float | None


@dataclass
class _Subscriber:
    loop: asyncio.AbstractEventLoop
    outputs: asyncio.Queue

    def deliver(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.outputs.put_nowait, item)


class AsyncLLMEngine:
    """Invariant: each submitted request receives outputs until one with finished=True, or one
    exception; abandoning the iterator (client gone) aborts the request and frees its blocks."""

    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._commands: queue.Queue = queue.Queue()
        self._subscribers: dict[str, _Subscriber] = {}
        self._stopped = threading.Event()
        self.stats: EngineStats = engine.stats()
        # (time.monotonic() when the engine thread began its current work, whether that is a step).
        self._working: tuple[float, bool] = (time.monotonic(), False)
        self._thread = threading.Thread(target=self._run, name="shoal-engine", daemon=True)
        self._thread.start()

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        jump_queue: bool = False,
        resume: Resume | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields one RequestOutput per step that produced tokens for this request. Raises the
        request's InvalidRequestError before the first output, or the error that ended it
        (EngineRequestError if the engine failed it; InvalidRequestError if its grammar ran into
        a dead end)."""
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        subscriber = _Subscriber(loop, asyncio.Queue())
        self._commands.put(("add", request_id, prompt, params, jump_queue, resume, subscriber, accepted))
        await accepted
        finished = False
        try:
            while not finished:
                item = await subscriber.outputs.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                if item.error:
                    raise item.error
                yield item
        finally:
            if not finished:
                self._commands.put(("abort", request_id))

    async def compile_grammar(self, spec: StructuredOutputs) -> None:
        """Compiles a request's grammar into the engine's cache in a thread of its own, so a new
        schema stalls neither the engine thread nor the event loop. Raises InvalidRequestError for
        a constraint that cannot be used."""
        await asyncio.to_thread(self.engine.grammars.compile, spec)

    async def export_kv(self, token_ids: list[int]) -> KVBlocks:
        """LLMEngine.export_kv, run on the engine thread between steps."""
        return await self._call(lambda engine: engine.export_kv(token_ids))

    async def import_kv(self, incoming: KVBlocks) -> int:
        """LLMEngine.import_kv, run on the engine thread between steps."""
        return await self._call(lambda engine: engine.import_kv(incoming))

    async def _call(self, function):
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(("call", function, loop, done))
        return await done

    def activity(self) -> EngineActivity:
        """From any thread: what the engine thread is doing now."""
        since, stepping = self._working
        return EngineActivity(time.monotonic() - since, self.engine.step_expected_s if stepping else None)

    def longest_step_s(self) -> float | None:
        """From any thread: how long the longest step the engine may run now should take (a full
        prefill chunk beside every running sequence); None while its speed is unknown."""
        engine = self.engine
        return engine.speed.step_seconds(engine.config.max_num_batched_tokens, self.stats.num_running)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def shutdown(self) -> None:
        """Stops the engine thread (a step waiting on other processes gives up), then the replica's
        other processes. Invariant: the engine is shut down only once its thread has ended."""
        self._stopped.set()
        self.engine.interrupt()
        self._commands.put(("wake",))
        self._thread.join(timeout=SHUTDOWN_WAIT_S)
        if self._thread.is_alive():
            log.error("the engine thread did not stop within %.0f s; its processes end with this one", SHUTDOWN_WAIT_S)
            return
        self.engine.shutdown()

    def _run(self) -> None:
        """Drains all pending commands, then steps; sleeps on the command queue when idle."""
        while not self._stopped.is_set():
            self._working = (time.monotonic(), False)
            idle = not self.engine.has_unfinished_requests()
            try:
                command = self._commands.get(timeout=0.5) if idle else self._commands.get_nowait()
            except queue.Empty:
                command = None
            if command is not None:
                self._handle(command)
            elif not idle:
                self._working = (time.monotonic(), True)
                self._step()
            else:
                continue
            self.stats = self.engine.stats()

    def _handle(self, command: tuple) -> None:
        kind = command[0]
        if kind == "add":
            _, request_id, prompt, params, jump_queue, resume, subscriber, accepted = command
            try:
                self.engine.add_request(
                    request_id,
                    prompt,
                    params,
                    jump_queue=jump_queue,
                    resume_token_ids=resume.token_ids if resume else None,
                    resume_text_offset=resume.text_offset if resume else None,
                )
            except Exception as exc:  # bad input: reported to this caller only
                subscriber.loop.call_soon_threadsafe(_resolve, accepted, None, exc)
                return
            self._subscribers[request_id] = subscriber
            subscriber.loop.call_soon_threadsafe(_resolve, accepted, None, None)
        elif kind == "call":
            _, function, loop, done = command
            try:
                result = function(self.engine)
            except Exception as exc:  # the caller's to handle
                loop.call_soon_threadsafe(_resolve, done, None, exc)
                return
            loop.call_soon_threadsafe(_resolve, done, result, None)
        elif kind == "abort":
            _, request_id = command
            subscriber = self._subscribers.pop(request_id, None)
            output = self.engine.abort_request(request_id)
            if subscriber and output:
                subscriber.deliver(output)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            if not self._stopped.is_set():
                log.exception("engine step failed; failing the requests in flight")
            for request_id, subscriber in list(self._subscribers.items()):
                self.engine.abort_request(request_id)
                subscriber.deliver(RuntimeError(f"engine step failed: {exc}"))
            self._subscribers.clear()
            return
        for output in outputs:
            subscriber = self._subscribers.get(output.request_id)
            if subscriber:
                subscriber.deliver(output)
                if output.finished:
                    del self._subscribers[output.request_id]


def _resolve(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
