"""Pipeline parallelism: the head runs the engine and the first layers; stage processes run the rest.

The head (this process) holds the embedding and the first stage's layers, schedules, samples, and
owns the block tables; every stage holds its layers' KV cache with the same block layout. A step's
hidden states travel head -> stage 1 -> ... -> last stage over ZeroMQ (in the model's dtype by
default, so 16-bit models send 2 bytes a value and results equal one process's), and the last
stage returns the logits of the rows to sample. Stages are linked by messages with deadlines, not
by a process group, so one lost stage does not take the others with it; the messages are typed
frames on links authenticated with the cluster secret (see stage_links).

Several micro-batches may be in flight (`submit` returns at once; `collect` waits for one), so
while stage 2 computes micro-batch i, the head computes i + 1 and the network carries i's output.

Stages are local processes the head starts, or `shoal stage` servers at given addresses (on this
machine or others); pipeline_plan lays them out. Stage failover: each sender keeps a boundary log (see
pipeline_stage.BoundaryLog). When a stage dies (its process exits) or hangs (no result within the
step deadline, and no answer to a ping), the head takes a replacement: a spare already holding
that stage's layers, else a spare or a new local process loading them, has the stage before it
replay its log for the live sequences (prompt and output tokens computed so far) so the replacement rebuilds its KV
cache, and sends the micro-batches in flight again (recomputing a slot writes the same values).
Output is unchanged. Free blocks still in the prefix cache are dropped from it, since no log
replay covers them. If no replacement is ready within the deadline, ReplicaFailedError.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from shoal.config.engine import EngineConfig
from shoal.errors import ReplicaFailedError
from shoal.model.llama import LlamaModel
from shoal.parallel.pipeline_plan import PipelineLayout
from shoal.parallel.pipeline_stage import BoundaryLog, wire_dtype
from shoal.parallel.stage_links import StageHandle
from shoal.parallel.stage_messages import batch_frame, send
from shoal.protocol.stage_frames import (
    HEAD_IDENT,
    Connect,
    Logits,
    Ping,
    Pong,
    Ready,
    ReplayDone,
    Replayed,
    SendReplay,
    Setup,
    Step,
    Stop,
    Upstream,
)
from shoal.runner.model_runner import ModelRunner
from shoal.runner.step_batch import StepBatch

log = logging.getLogger(__name__)

LiveSequences = Callable[[], list[tuple[list[int], int]]]
MAX_REPLACEMENTS_PER_STEP = 2
# How long, all together, the local stages have to exit after Stop on shutdown. The engine thread
# has ended by then, so a stage is between steps and exits at once unless it is hung.
STOP_GRACE_S = 3.0


class StageLost(Exception):
    """A stage process exited, or a wait passed its deadline."""


@dataclass(frozen=True)
class PipelineSettings:
    """spare_addresses and local_spares: spare stage servers, each loaded at start with the layers
    of one stage (spread over the stages) and waiting to take over from a lost one;
    step_deadline_s: how long a micro-batch may take end to end before the stages are checked;
    ping_timeout_s: how long a live stage has to answer; replacement_timeout_s: how long a
    replacement stage may take to load and replay before the replica gives up."""

    wire_dtype: str = "auto"
    step_deadline_s: float = 30.0
    ping_timeout_s: float = 10.0
    replacement_timeout_s: float = 120.0
    spare_addresses: tuple[str, ...] = ()
    local_spares: int = 0


class PipelineRunner(ModelRunner):
    """The head's runner. Invariants: `in_flight` holds, in submission order, every micro-batch sent
    and not yet collected; every live stage has received each of them after its last replay."""

    def __init__(
        self,
        config: EngineConfig,
        model: LlamaModel,
        layout: PipelineLayout,
        live_sequences: LiveSequences,
        forget_unreplayed: Callable[[], None],
        settings: PipelineSettings = PipelineSettings(),
    ):
        super().__init__(model, layout.num_blocks, config.block_size)
        self.config, self.plan, self.profiles, self.settings = config, layout.plan, layout.profiles, settings
        self.live_sequences, self.forget_unreplayed = live_sequences, forget_unreplayed
        self.links = layout.links
        self.inbox, self.address = self.links.inbox, self.links.address
        self.wire = wire_dtype(settings.wire_dtype, model.dtype)
        self.log = BoundaryLog(self.num_blocks * self.block_size, model.config.hidden_size, self.wire, self.block_size)
        self.step_ids = itertools.count()
        self.in_flight: dict[int, StepBatch] = {}
        self.results: dict[int, torch.Tensor] = {}
        # Stage compute times of micro-batches in flight (the head's) and collected (every stage's).
        self.head_times: dict[int, tuple[int, int, int]] = {}
        self.times: dict[int, list[tuple[int, int, int]]] = {}
        self.collected_times: tuple[int, list[tuple[int, int, int]]] = (-1, [])
        self.stages: list[StageHandle | None] = [None, *layout.stages]
        self.spares: list[StageHandle] = []
        self.downstream: zmq.Socket | None = None
        self.wire_bytes = 0  # activations sent by the head for micro-batches (replays not counted)
        self.wire_tokens = 0
        self.replays = 0
        self.head_busy_s = 0.0
        self.interrupted = threading.Event()
        try:
            for index in range(len(self.stages) - 1, 0, -1):  # last first: each needs its downstream's address
                self._set_up(self.stages[index], index, self._downstream_of(index), self._upstream_of(index))
            self._connect_downstream()
            spares = [self.links.handle(address) for address in settings.spare_addresses]
            spares += [self.links.handle() for _ in range(settings.local_spares)]
            self.spares = [
                self._set_up(spare, 1 + i % (len(self.stages) - 1), None, None) for i, spare in enumerate(spares)
            ]
        except BaseException:
            self.shutdown()
            raise

    # Starting and replacing stages.

    def _downstream_of(self, index: int) -> str | None:
        """The next stage's inbox (None while that stage is being replaced), or the head's."""
        if index + 1 == len(self.stages):
            return self.address
        following = self.stages[index + 1]
        return following.inbox if following else None

    def _upstream_of(self, index: int) -> int:
        return self.stages[index - 1].ident if index > 1 else HEAD_IDENT

    def _set_up(self, handle: StageHandle, index: int, downstream: str | None, upstream: int | None) -> StageHandle:
        """Loads stage `index`'s layers on `handle` (a cold load); returns it once ready."""
        spec = self.plan.stages[index]
        config = self._stage_config(handle, index).to_json()
        send(
            handle.control,
            Setup(
                index,
                handle.ident,
                config,
                spec.first_layer,
                spec.end_layer,
                self.num_blocks,
                downstream,
                upstream,
                self.address,
                self.settings.wire_dtype,
            ),
        )
        self._await_control(
            lambda m: isinstance(m, Ready) and m.ident == handle.ident, f"stage {index} did not load its layers"
        )
        handle.stage = index
        return handle

    def _stage_config(self, handle: StageHandle, index: int) -> EngineConfig:
        """On CUDA, local stage processes take the GPUs after the head's in turn; stage servers
        started elsewhere resolve the device where they run."""
        device = self.model.device
        if handle.process is None or device.type != "cuda":
            return self.config
        return dataclasses.replace(self.config, device=f"cuda:{(device.index + index) % torch.cuda.device_count()}")

    def _replacement(self, index: int) -> StageHandle:
        """A spare already holding stage `index`'s layers, else any spare loaded anew, else a new
        local stage process: connected to the stage's downstream."""
        downstream, upstream = self._downstream_of(index), self._upstream_of(index)
        warm = next((spare for spare in self.spares if spare.stage == index and spare.alive()), None)
        if warm is not None:
            self.spares.remove(warm)
            send(warm.control, Connect(downstream, upstream))
            self._await_control(
                lambda m: isinstance(m, Ready) and m.ident == warm.ident, f"spare for stage {index} did not connect"
            )
            log.warning("pipeline stage %d: spare %s takes over with its layers loaded", index, warm.inbox)
            return warm
        cold = next((spare for spare in self.spares if spare.alive()), None) or self.links.handle()
        if cold in self.spares:
            self.spares.remove(cold)
        log.warning("pipeline stage %d: loading its layers on %s", index, cold.inbox)
        return self._set_up(cold, index, downstream, upstream)

    def _connect_downstream(self) -> None:
        if self.downstream is not None:
            self.downstream.close(linger=0)
        self.downstream = self.links.context.connect(zmq.PUSH, self.stages[1].inbox)
        self.downstream.setsockopt(zmq.LINGER, 0)

    def _replace_lost(self, lost: list[int]) -> None:
        """Replaces the lost stages in pipeline order, so that each replacement's upstream already
        holds its rebuilt boundary log; then sends the micro-batches in flight again."""
        for index in lost:
            log.warning("pipeline stage %d is lost; replacing it and replaying its boundary log", index)
            self.stages[index].close()
            self.stages[index] = None
        self.results.clear()
        for index in sorted(lost):
            self._replace(index)
        for step_id, batch in list(self.in_flight.items()):
            self._submit_as(step_id, batch)

    def _replace(self, index: int) -> None:
        self.stages[index] = self._replacement(index)
        following = self.stages[index + 1] if index + 1 < len(self.stages) else None
        if following is not None:  # it takes steps from the replacement only
            send(following.control, Upstream(self.stages[index].ident))
            self._await_control(
                lambda m: isinstance(m, Ready) and m.ident == following.ident,
                f"stage {index + 1} did not take its new upstream",
            )
        sequences = [(table, tokens) for table, tokens in self.live_sequences() if tokens]
        self.forget_unreplayed()
        if index == 1:
            self._connect_downstream()
            for table, tokens in sequences:
                batch, rows = self.log.replay(table, tokens)
                send(self.downstream, Step(-1, batch_frame(batch), HEAD_IDENT, replay=True), rows)
            send(self.downstream, ReplayDone(len(sequences), HEAD_IDENT))
        else:
            send(self.stages[index - 1].control, SendReplay(self.stages[index].inbox, sequences))
        replacement = self.stages[index]
        self._await_control(
            lambda m: isinstance(m, Replayed) and m.ident == replacement.ident,
            f"replacement stage {index} did not rebuild its KV cache",
        )
        self.replays += 1
        log.warning(
            "pipeline stage %d replaced: KV cache rebuilt from the boundary log for %d sequences (%d tokens)",
            index,
            len(sequences),
            sum(tokens for _, tokens in sequences),
        )

    # Running micro-batches.

    @property
    def depth(self) -> int:
        return len(self.stages)

    def run(self, batch: StepBatch) -> torch.Tensor:
        return self.collect(self.submit(batch))

    def submit(self, batch: StepBatch) -> int:
        """Runs the head's layers and sends the result on; returns the micro-batch's id."""
        step_id = next(self.step_ids)
        self._submit_as(step_id, batch)
        self.in_flight[step_id] = batch
        return step_id

    def _submit_as(self, step_id: int, batch: StepBatch) -> None:
        started, started_ns = time.perf_counter(), time.time_ns()
        hidden = self.run_layers(batch, torch.tensor(batch.input_ids, device=self.model.device))
        outgoing = hidden.to(self.wire).cpu()
        self.log.record(batch, outgoing)
        self.head_busy_s += time.perf_counter() - started
        self.head_times[step_id] = (0, started_ns, time.time_ns())
        self.wire_bytes += send(self.downstream, Step(step_id, batch_frame(batch), HEAD_IDENT), outgoing)
        self.wire_tokens += len(batch.input_ids)

    def collect(self, step_id: int) -> torch.Tensor:
        """The logits of a submitted micro-batch, replacing lost stages on the way if need be."""
        replaced = 0
        while step_id not in self.results:
            try:
                self._await(lambda m: isinstance(m, Logits) and m.step_id == step_id, self.settings.step_deadline_s)
            except StageLost:
                lost = self._unresponsive_stages()
                if lost and replaced == MAX_REPLACEMENTS_PER_STEP:  # the batch itself kills stages
                    raise ReplicaFailedError(
                        f"micro-batch {step_id} lost stages {MAX_REPLACEMENTS_PER_STEP} times"
                    ) from None
                if lost:
                    self._replace_lost(lost)
                    replaced += 1
        del self.in_flight[step_id]
        self.collected_times = (step_id, self.times.pop(step_id, []))
        return self.results.pop(step_id)

    def stage_times(self, step_id: int) -> list[tuple[int, int, int]]:
        collected, times = self.collected_times
        return times if collected == step_id else []

    def _await_control(self, wanted: Callable[[object], bool], what: str) -> None:
        try:
            self._await(wanted, self.settings.replacement_timeout_s)
        except StageLost:
            raise ReplicaFailedError(
                f"pipeline: {what} within {self.settings.replacement_timeout_s:.0f} s, "
                f"or another stage was lost meanwhile"
            ) from None

    def _await(self, wanted: Callable[[object], bool], timeout_s: float) -> object:
        """Reads the inbox (keeping the logits of micro-batches in flight) until `wanted` matches.
        Raises StageLost when a stage process exits or timeout_s passes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.interrupted.is_set():
                raise ReplicaFailedError("the pipeline was interrupted: the replica is shutting down")
            message = self._receive(100)
            if message is not None:
                if wanted(message):
                    return message
            elif self._exited() or time.monotonic() >= deadline:
                raise StageLost()

    def _receive(self, wait_ms: int) -> object | None:
        """The next message within wait_ms, or None; the logits of a micro-batch in flight are kept
        (if they are one row of the vocabulary per row the batch samples)."""
        if not self.inbox.poll(wait_ms) or (received := self.links.receive()) is None:
            return None
        message, tensor = received
        last = self.stages[-1]
        if (
            isinstance(message, Logits)
            and message.step_id in self.in_flight
            and last is not None
            and message.sender == last.ident
        ):  # not from a replaced last stage
            expected = (len(self.in_flight[message.step_id].last_rows), self.model.config.vocab_size)
            if tuple(tensor.shape) != expected:
                log.warning(
                    "pipeline head dropped logits of shape %s for micro-batch %d, not %s",
                    list(tensor.shape),
                    message.step_id,
                    list(expected),
                )
                return None
            self.results[message.step_id] = tensor
            self.times[message.step_id] = [self.head_times.pop(message.step_id), *message.stage_times]
        return message

    def _exited(self) -> list[int]:
        return [i for i, s in enumerate(self.stages) if s is not None and not s.alive()]

    def _unresponsive_stages(self) -> list[int]:
        """Stages whose process exited, or that do not answer a ping in time (hung, or unreachable)."""
        dead = self._exited()
        if dead:
            return dead
        answered = self._ping_all(self.settings.ping_timeout_s)
        return [i for i, s in enumerate(self.stages) if s is not None and s.ident not in answered]

    def _ping_all(self, timeout_s: float) -> dict[int, float]:
        """Pings every stage; returns {ident: busy seconds} of those that answered within timeout_s."""
        nonce = next(self.step_ids)
        stages = [s for s in self.stages if s is not None]
        for stage in stages:
            send(stage.control, Ping(nonce))
        answered: dict[int, float] = {}
        deadline = time.monotonic() + timeout_s
        while len(answered) < len(stages) and time.monotonic() < deadline:
            message = self._receive(50)
            if isinstance(message, Pong) and message.nonce == nonce:
                answered[message.ident] = message.busy_s
        return answered

    def stage_busy_seconds(self) -> list[float]:
        """Seconds each stage (head first) has spent computing, for the bubble fraction (NaN for a
        stage that does not answer in time)."""
        busy = self._ping_all(self.settings.ping_timeout_s)
        return [self.head_busy_s] + [busy.get(s.ident, float("nan")) for s in self.stages[1:]]

    def interrupt(self) -> None:
        self.interrupted.set()

    def shutdown(self) -> None:
        handles = [s for s in self.stages[1:] if s is not None] + self.spares
        for handle in handles:
            if handle.alive():
                send(handle.control, Stop())
        deadline = time.monotonic() + STOP_GRACE_S
        for handle in handles:
            if handle.process is not None:
                try:
                    handle.process.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
            handle.close()  # kills a local stage still running: hung, it would never read Stop
        self.links.close()  # every socket, including a half-made replacement's
