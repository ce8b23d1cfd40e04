"""Pipeline parallelism: the head runs the engine and the first layers; stage processes run the rest.

The head (this process) holds the embedding and the first stage's layers, schedules, samples, and
owns the block tables; every stage holds its layers' KV cache with the same block layout. A step's
hidden states travel head -> stage 1 -> ... -> last stage over ZeroMQ (in the model's dtype by
default, so 16-bit models send 2 bytes a value and results equal one process's), and the last
stage returns the logits of the rows to sample. Stages are linked by messages with deadlines, not
by a process group, so one lost stage does not take the others with it.

Several micro-batches may be in flight (`submit` returns at once; `collect` waits for one), so
while stage 2 computes micro-batch i, the head computes i + 1 and the network carries i's output.

Stage failover: each sender keeps a boundary log (see pipeline_stage.BoundaryLog). When a stage
dies (its process exits) or hangs (no result within the step deadline, and no answer to a ping),
the head starts a replacement with the same layers, has the stage before it replay its log for
the live sequences (prompt and output tokens computed so far) so the replacement rebuilds its KV
cache, and sends the micro-batches in flight again (recomputing a slot writes the same values).
Output is unchanged. Free blocks still in the prefix cache are dropped from it, since no log
replay covers them. If no replacement is ready within the deadline, ReplicaFailedError.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import zmq

from shoal.engine.config import EngineConfig
from shoal.engine.model_runner import ModelRunner, StepBatch
from shoal.engine.scheduler import ScheduledChunk
from shoal.errors import ReplicaFailedError
from shoal.model.config import LlamaConfig
from shoal.model.llama import LlamaModel
from shoal.parallel.partition import ModelCost, PartitionPlan, StageNode, plan_from_counts, plan_partition
from shoal.parallel.pipeline_stage import BoundaryLog, wire_dtype
from shoal.parallel.stage_messages import (Logits, Ping, Pong, Ready, Replayed, ReplayDone, Setup, SendReplay, Step,
                                           Stop, receive, send)
from shoal.processes import die_with_parent, free_port

log = logging.getLogger(__name__)

LiveSequences = Callable[[], list[tuple[list[int], int]]]


class StageLost(Exception):
    """A stage process exited, or a wait passed its deadline."""


@dataclass(frozen=True)
class PipelineSettings:
    """step_deadline_s: how long a micro-batch may take end to end before the stages are checked;
    ping_timeout_s: how long a live stage has to answer; replacement_timeout_s: how long a
    replacement stage may take to load and replay before the replica gives up."""

    wire_dtype: str = "auto"
    step_deadline_s: float = 30.0
    ping_timeout_s: float = 2.0
    replacement_timeout_s: float = 120.0


def plan_stages(config: LlamaConfig, stages: int, layers_per_stage: tuple[int, ...] | None,
                bytes_per_value: int = 2) -> PartitionPlan:
    """Layers per stage for stages on one host. Their speed per layer is the same, so the planner
    balances layers against the LM head's extra work on the last stage (in layer-equivalents:
    "ms/step" in the plan reads as 1 per layer); memory is the weights'. `layers_per_stage`
    overrides the plan (checked)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    layer_values = hidden * config.head_dim * 2 * (config.num_heads + config.num_kv_heads) + 3 * hidden * inter
    head_values = config.vocab_size * hidden
    model = ModelCost(num_layers=config.num_layers, layer_bytes=layer_values * bytes_per_value,
                      embed_bytes=head_values * bytes_per_value, head_bytes=head_values * bytes_per_value,
                      head_seconds=1e-3 * head_values / layer_values)
    nodes = [StageNode(f"local stage {i}", 1e-3, 1 << 62) for i in range(stages)]
    if layers_per_stage:
        return plan_from_counts(nodes, model, list(layers_per_stage))
    return plan_partition(nodes, model)


class StageProcess:
    """A local stage process and the head's control socket to its inbox."""

    def __init__(self, context: zmq.Context, index: int):
        self.index = index
        self.inbox = f"tcp://127.0.0.1:{free_port()}"
        self.process = subprocess.Popen([sys.executable, "-m", "shoal.parallel.pipeline_stage", "--bind", self.inbox],
                                        preexec_fn=die_with_parent)
        self.control = context.socket(zmq.PUSH)
        self.control.setsockopt(zmq.LINGER, 0)
        self.control.connect(self.inbox)

    def alive(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        if self.alive():
            self.process.kill()
        self.process.wait()
        self.control.close(linger=0)


class PipelineRunner(ModelRunner):
    """The head's runner. Invariants: `in_flight` holds, in submission order, every micro-batch sent
    and not yet collected; every live stage has received each of them after its last replay."""

    def __init__(self, config: EngineConfig, model: LlamaModel, plan: PartitionPlan, num_blocks: int, block_size: int,
                 live_sequences: LiveSequences, forget_unreplayed: Callable[[], None],
                 settings: PipelineSettings = PipelineSettings()):
        super().__init__(model, num_blocks, block_size)
        self.config, self.plan, self.settings = config, plan, settings
        self.live_sequences, self.forget_unreplayed = live_sequences, forget_unreplayed
        self.context = zmq.Context()
        self.inbox = self.context.socket(zmq.PULL)
        self.address = f"tcp://127.0.0.1:{self.inbox.bind_to_random_port('tcp://127.0.0.1')}"
        self.wire = wire_dtype(settings.wire_dtype, model.dtype)
        self.log = BoundaryLog(num_blocks * block_size, model.config.hidden_size, self.wire, block_size)
        self.step_ids = itertools.count()
        self.in_flight: dict[int, StepBatch] = {}
        self.results: dict[int, torch.Tensor] = {}
        self.stages: list[StageProcess | None] = [None] * len(plan.stages)
        self.downstream: zmq.Socket | None = None
        self.wire_bytes = 0
        self.wire_tokens = 0
        self.replays = 0
        self.head_busy_s = 0.0
        self.started = time.monotonic()
        for index in range(len(plan.stages) - 1, 0, -1):  # last first: each needs its downstream's address
            self._start_stage(index)
        self._connect_downstream()

    # Starting and replacing stages.

    def _downstream_of(self, index: int) -> str:
        following = self.stages[index + 1] if index + 1 < len(self.stages) else None
        return following.inbox if following else self.address

    def _start_stage(self, index: int) -> None:
        stage = StageProcess(self.context, index)
        self.stages[index] = stage
        spec = self.plan.stages[index]
        send(stage.control, Setup(index, dataclasses.asdict(self.config), spec.first_layer, spec.end_layer,
                                  self.num_blocks, self._downstream_of(index), self.address, self.settings.wire_dtype))
        self._await_control(lambda m: isinstance(m, Ready) and m.stage == index, f"stage {index} did not load its layers")

    def _connect_downstream(self) -> None:
        if self.downstream is not None:
            self.downstream.close(linger=0)
        self.downstream = self.context.socket(zmq.PUSH)
        self.downstream.setsockopt(zmq.LINGER, 0)
        self.downstream.connect(self.stages[1].inbox)

    def _replace(self, index: int) -> None:
        log.warning("pipeline stage %d is lost; starting a replacement and replaying its boundary log", index)
        self.stages[index].kill()
        self.results.clear()
        self._start_stage(index)
        sequences = [(table, tokens) for table, tokens in self.live_sequences() if tokens]
        self.forget_unreplayed()
        if index == 1:
            self._connect_downstream()
            for table, tokens in sequences:
                batch, rows = self.log.replay(table, tokens)
                self._send(Step(-1, batch, replay=True), rows)
            send(self.downstream, ReplayDone(len(sequences)))
        else:
            send(self.stages[index - 1].control, SendReplay(self.stages[index].inbox, sequences))
        self._await_control(lambda m: isinstance(m, Replayed) and m.stage == index,
                            f"replacement stage {index} did not rebuild its KV cache")
        self.replays += 1
        log.warning("pipeline stage %d replaced: KV cache rebuilt from the boundary log for %d sequences (%d tokens)",
                    index, len(sequences), sum(tokens for _, tokens in sequences))
        for step_id, batch in list(self.in_flight.items()):
            self._submit_as(step_id, batch)

    # Running micro-batches.

    @property
    def depth(self) -> int:
        return len(self.stages)

    def run(self, batch: StepBatch) -> torch.Tensor:
        return self.collect(self._submit_batch(batch))

    def submit(self, chunks: list[ScheduledChunk]) -> int:
        return self._submit_batch(StepBatch.from_chunks(chunks))

    def _submit_batch(self, batch: StepBatch) -> int:
        """Runs the head's layers and sends the result on; returns the micro-batch's id."""
        step_id = next(self.step_ids)
        self.in_flight[step_id] = batch
        self._submit_as(step_id, batch)
        return step_id

    def _submit_as(self, step_id: int, batch: StepBatch) -> None:
        started = time.perf_counter()
        hidden = self.run_layers(batch, torch.tensor(batch.input_ids, device=self.model.device))
        outgoing = hidden.to(self.wire).cpu()
        self.log.record(batch, outgoing)
        self.head_busy_s += time.perf_counter() - started
        self._send(Step(step_id, batch), outgoing)
        self.wire_tokens += len(batch.input_ids)

    def _send(self, step: Step, rows: torch.Tensor) -> None:
        self.wire_bytes += send(self.downstream, step, rows)

    def collect(self, step_id: int) -> torch.Tensor:
        """The logits of a submitted micro-batch, replacing lost stages on the way if need be."""
        while step_id not in self.results:
            try:
                self._await(lambda m: isinstance(m, Logits) and m.step_id == step_id, self.settings.step_deadline_s)
            except StageLost:
                for index in self._unresponsive_stages():
                    self._replace(index)
        del self.in_flight[step_id]
        return self.results.pop(step_id)

    def _await_control(self, wanted: Callable[[object], bool], what: str) -> None:
        try:
            self._await(wanted, self.settings.replacement_timeout_s)
        except StageLost:
            raise ReplicaFailedError(f"pipeline: {what} within {self.settings.replacement_timeout_s:.0f} s, "
                                     f"or another stage was lost meanwhile") from None

    def _await(self, wanted: Callable[[object], bool], timeout_s: float) -> object:
        """Reads the inbox (keeping the logits of micro-batches in flight) until `wanted` matches.
        Raises StageLost when a stage process exits or timeout_s passes first."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.inbox.poll(100):
                message, tensor = receive(self.inbox)
                if isinstance(message, Logits) and message.step_id in self.in_flight:
                    self.results[message.step_id] = tensor
                if wanted(message):
                    return message
            elif self._exited() or time.monotonic() >= deadline:
                raise StageLost()

    def _exited(self) -> list[int]:
        return [s.index for s in self.stages if s is not None and not s.alive()]

    def _unresponsive_stages(self) -> list[int]:
        """Stages whose process exited, or that do not answer a ping in time (hung)."""
        dead = self._exited()
        if dead:
            return dead
        nonce = next(self.step_ids)
        for stage in self.stages[1:]:
            send(stage.control, Ping(nonce))
        answered: set[int] = set()
        deadline = time.monotonic() + self.settings.ping_timeout_s
        while len(answered) < len(self.stages) - 1 and time.monotonic() < deadline:
            if self.inbox.poll(50):
                message, tensor = receive(self.inbox)
                if isinstance(message, Pong) and message.nonce == nonce:
                    answered.add(message.stage)
                elif isinstance(message, Logits) and message.step_id in self.in_flight:
                    self.results[message.step_id] = tensor
        return [s.index for s in self.stages[1:] if s.index not in answered]

    def stage_busy_seconds(self) -> list[float]:
        """Seconds each stage (head first) has spent computing, for the bubble fraction."""
        nonce = next(self.step_ids)
        for stage in self.stages[1:]:
            send(stage.control, Ping(nonce))
        busy = {0: self.head_busy_s}
        while len(busy) < len(self.stages):
            message, tensor = receive(self.inbox)
            if isinstance(message, Pong) and message.nonce == nonce:
                busy[message.stage] = message.busy_s
            elif isinstance(message, Logits) and message.step_id in self.in_flight:
                self.results[message.step_id] = tensor
        return [busy[i] for i in range(len(self.stages))]

    def shutdown(self) -> None:
        for stage in self.stages[1:]:
            if stage.alive():
                send(stage.control, Stop())
        for stage in self.stages[1:]:
            try:
                stage.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            stage.kill()
        self.inbox.close(linger=0)
        if self.downstream is not None:
            self.downstream.close(linger=0)
        self.context.term()
