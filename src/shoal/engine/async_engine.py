"""Async front of the engine: submit, stream tokens, abort. The engine runs in its own thread.

All engine state is touched by that thread only, from the engine's construction on; callers talk to
it through a command queue and get outputs through per-request asyncio queues, so a slow step never
blocks the caller's event loop. Other threads read the engine's figures from `stats`, a snapshot the
engine thread republishes after every command and step.

The engine is built, calibrated and stepped on that one thread because torch's CPU kernels run on
OpenMP, and GNU OpenMP keeps one thread team per thread that starts parallel regions. With more
team threads than CPUs (a team built by the thread that loaded the model, and another by the thread
that steps it) it stops spinning between parallel regions: every region of a step then waits for
its sleeping threads to be woken, which made a served token take twice as long as an offline one.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import torch

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
    """Invariants: each submitted request receives outputs until one with finished=True, or one
    exception; abandoning the iterator (client gone) aborts the request and frees its blocks. The
    engine is built by `build` on the engine thread, and every call into it (steps, commands,
    `call_sync`) runs there; the constructor returns once it is built, or raises what `build` raised."""

    def __init__(self, build: Callable[[], LLMEngine]):
        self._commands: queue.Queue = queue.Queue()
        self._subscribers: dict[str, _Subscriber] = {}
        self._stopped = threading.Event()
        # LoRA adapters whose files are being read off the engine thread, by name (event loop thread only).
        self.lora_reads: dict[str, asyncio.Future] = {}
        # (time.monotonic() when the engine thread began its current work, whether that is a step).
        self._working: tuple[float, bool] = (time.monotonic(), False)
        built: concurrent.futures.Future[LLMEngine] = concurrent.futures.Future()
        self._thread = threading.Thread(target=self._run, args=(build, built), name="shoal-engine", daemon=True)
        self._thread.start()
        built.result()  # the engine thread has set self.engine, or this raises what build raised

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        scheduling: str = "interactive",
        resume: Resume | None = None,
        lora: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yields one RequestOutput per step that produced tokens for this request. Raises the
        request's InvalidRequestError before the first output, or the error that ended it
        (EngineRequestError if the engine failed it; InvalidRequestError if its grammar ran into
        a dead end). `lora` names the LoRA adapter the request runs."""
        request_id = request_id or uuid.uuid4().hex
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        subscriber = _Subscriber(loop, asyncio.Queue())
        self._commands.put(("add", request_id, prompt, params, scheduling, resume, lora, subscriber, accepted))
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

    async def embed(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """LLMEngine.embed, run on the engine thread between steps."""
        return await self._call(lambda engine: engine.embed(prompts))

    async def load_lora_adapter(self, name: str, path: str, sha256: str | None) -> None:
        """Reads a LoRA adapter's files in a thread of their own (the engine steps on meanwhile),
        then checks and holds it on the engine thread between steps (LoraRegistry.admit). Loading
        one again from the same file only makes sure it is held."""
        registry = self.engine.lora_registry()
        known = registry.known.get(name)
        if known is not None and (known.path, known.sha256) == (path, sha256):
            return await self.hold_lora_adapter(name)  # loaded before: at most read again
        files, read_s = await self._reading(name, lambda: registry.read(path, sha256))
        await self._call(lambda engine: registry.admit(name, path, sha256, files, read_s))

    async def hold_lora_adapter(self, name: str) -> None:
        """Before a request runs adapter `name`: where the engine knows it but has given it back
        (LoraRegistry.max_cpu_loras), its files are read again off the engine thread, so the steps
        of others do not wait on the disk. One read at a time a name."""
        registry = self.engine.loras
        source = registry.source(name) if registry is not None else None
        if source is None:
            return
        reading = self.lora_reads.get(name)
        if reading is None:
            files, read_s = await self._reading(name, lambda: registry.read(source.path, source.digest))
            await self._call(lambda engine: registry.refill(name, files, read_s))
        else:
            await asyncio.shield(reading)

    async def _reading(self, name: str, read: Callable):
        """read() in a thread, its name in `lora_reads` until it ends."""
        task = asyncio.ensure_future(asyncio.to_thread(read))
        self.lora_reads.setdefault(name, task)
        try:
            return await task
        finally:
            if self.lora_reads.get(name) is task:
                del self.lora_reads[name]

    async def unload_lora_adapter(self, name: str) -> None:
        """LLMEngine.unload_lora_adapter, run on the engine thread between steps."""
        await self._call(lambda engine: engine.unload_lora_adapter(name))

    async def _call(self, function):
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._commands.put(("call", function, functools.partial(loop.call_soon_threadsafe, _resolve, done)))
        return await done

    def call_sync(self, function: Callable[[LLMEngine], object]) -> object:
        """Runs function(engine) on the engine thread between steps and returns its result (or
        raises its exception); blocks the calling thread, so not for an event loop's thread."""
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put(("call", function, functools.partial(_settle, done)))
        return done.result()

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

    def _run(self, build: Callable[[], LLMEngine], built: concurrent.futures.Future) -> None:
        """Builds the engine, then drains all pending commands and steps; sleeps on the command
        queue when idle."""
        try:
            self.engine: LLMEngine = build()
            self.stats: EngineStats = self.engine.stats()
        except BaseException as exc:  # the constructor's caller raises it
            built.set_exception(exc)
            return
        built.set_result(self.engine)
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
            _, request_id, prompt, params, scheduling, resume, lora, subscriber, accepted = command
            try:
                self.engine.add_request(
                    request_id,
                    prompt,
                    params,
                    scheduling=scheduling,
                    resume_token_ids=resume.token_ids if resume else None,
                    resume_text_offset=resume.text_offset if resume else None,
                    lora=lora,
                )
            except Exception as exc:  # bad input: reported to this caller only
                subscriber.loop.call_soon_threadsafe(_resolve, accepted, None, exc)
                return
            self._subscribers[request_id] = subscriber
            subscriber.loop.call_soon_threadsafe(_resolve, accepted, None, None)
        elif kind == "call":
            _, function, reply = command
            try:
                result = function(self.engine)
            except Exception as exc:  # the caller's to handle
                reply(None, exc)
                return
            reply(result, None)
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


def _settle(future: concurrent.futures.Future, result: object, error: BaseException | None) -> None:
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)


def _resolve(future: asyncio.Future, result: object, error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(result)
    else:
        future.set_exception(error)
