"""A pipeline stage process: layers [first, end) of a model, their paged KV cache, and the boundary
log of what it sent downstream.

It serves one ZeroMQ inbox in order. A Step runs the stage's layers on the incoming hidden states
(writing the KV cache at the batch's slots, with the block tables the head assigned), records the
outgoing rows in the boundary log, and forwards them; the last stage instead returns the logits of
the batch's last rows to the head. The boundary log is a shadow of the KV cache's layout — one row
of outgoing activations per KV slot — so it needs no bookkeeping per request: it always holds,
for every slot the head considers computed, what this stage sent for it. When the next stage is
replaced, SendReplay streams the rows of the live sequences to the replacement, which rebuilds its
KV cache (and its own boundary log) from them.

Its links are ZeroMQ CURVE with the cluster secret (see cluster_sockets): only processes holding
$SHOAL_CLUSTER_SECRET can connect, and a frame that is not a valid message for its inbox is dropped
with a warning, never answered.

    SHOAL_CLUSTER_SECRET=... shoal stage [--bind tcp://127.0.0.1:7100]   (or python -m shoal.parallel.pipeline_stage)

It binds loopback unless given another address (`--bind tcp://10.0.0.5:7100` to serve heads on
other machines).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import time

import torch
import zmq

from shoal.config.engine import EngineConfig
from shoal.model.loader import Checkpoint, load_checkpoint
from shoal.observability.logging import configure_logging
from shoal.parallel.cluster_sockets import ClusterContext
from shoal.parallel.pipeline_kv_groups import pipeline_kv_groups
from shoal.parallel.stage_messages import batch_frame, receive, send, step_batch
from shoal.parallel.stage_profile import measure_node
from shoal.protocol.cluster_secret import MissingClusterSecret, required_secret
from shoal.protocol.frames import WIRE_DTYPES, BadFrame
from shoal.protocol.stage_frames import (
    STAGE_INBOX,
    Connect,
    Logits,
    Ping,
    Pong,
    Probe,
    Profiled,
    Ready,
    ReplayDone,
    Replayed,
    SendReplay,
    Setup,
    Step,
    Stop,
    Upstream,
)
from shoal.runner.devices import keeps_quantized, resolve_device, resolve_dtype
from shoal.runner.model_runner import ModelRunner, build_model
from shoal.runner.step_batch import StepBatch

log = logging.getLogger("shoal.parallel.pipeline_stage")


class BoundaryLog:
    """Outgoing activations, one row per KV slot of the pipeline's one KV group. Invariant: for every
    slot written by the step that computed it, the row is what was sent downstream for that slot."""

    def __init__(self, num_slots: int, hidden_size: int, dtype: torch.dtype, block_size: int):
        self.rows = torch.zeros(num_slots, hidden_size, dtype=dtype)
        self.block_size = block_size

    def slots(self, batch: StepBatch) -> torch.Tensor:
        bs = self.block_size
        return torch.tensor(
            [
                table[p // bs] * bs + p % bs
                for table, start, length in zip(batch.block_tables[0], batch.start_positions, batch.query_lens)
                for p in range(start, start + length)
            ],
            dtype=torch.int64,
        )

    def record(self, batch: StepBatch, hidden: torch.Tensor) -> None:
        self.rows.index_copy_(0, self.slots(batch), hidden)

    def replay(self, block_table: list[int], tokens: int) -> tuple[StepBatch, torch.Tensor]:
        """One sequence's first `tokens` positions as a batch, with the rows sent for them."""
        batch = StepBatch([], list(range(tokens)), [tokens], [0], [[block_table]], [])
        return batch, self.rows[self.slots(batch)]


def wire_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """ "auto": the model's own dtype (lossless; 16-bit models send 2 bytes a value)."""
    return model_dtype if name == "auto" else getattr(torch, name)


class StageServer:
    """One stage. Invariants: messages are handled in the order they arrive in the inbox; a message
    that is invalid, or not valid before a Setup, is dropped with a warning and changes nothing."""

    def __init__(self, inbox: str, secret: str, num_threads: int | None = None):
        """num_threads: this node's CPU threads, whatever the head's config says."""
        self.num_threads = num_threads
        if num_threads:
            torch.set_num_threads(num_threads)
        self.links = ClusterContext(secret)
        self.inbox = self.links.bind(zmq.PULL, inbox)
        self.head: zmq.Socket | None = None
        self.downstream: zmq.Socket | None = None
        self.runner: ModelRunner | None = None
        self.ident = -1
        self.upstream: int | None = None
        self.busy_s = 0.0

    def _push(self, address: str) -> zmq.Socket:
        try:
            return self.links.connect(zmq.PUSH, address)
        except zmq.ZMQError as error:
            raise BadFrame(f"cannot connect to {address!r}: {error}") from None

    def serve(self, persistent: bool = False) -> None:
        """Handles messages until Stop; a persistent server (`shoal stage`) then drops its layers
        and waits for its next head instead of exiting."""
        while True:
            try:
                message, tensor = receive(self.inbox, STAGE_INBOX)
                if isinstance(message, Stop) and not persistent:
                    return
                self._handle(message, tensor)
            except BadFrame as error:
                log.warning("dropped a message: %s", error)

    def _handle(self, message: object, tensor: torch.Tensor | None) -> None:
        if isinstance(message, Stop):
            self.runner = None
            log.info("released by its head; waiting for the next one")
        elif isinstance(message, Probe):
            self._probe(message)
        elif isinstance(message, Setup):
            self._setup(message)
        elif self.runner is None:
            raise BadFrame(f"{type(message).__name__} before any Setup")
        elif isinstance(message, Step | ReplayDone) and message.sender != self.upstream:
            log.warning("dropped %s from %d, a former upstream", type(message).__name__, message.sender)
        elif isinstance(message, Step):
            started = time.perf_counter()
            self._step(message, tensor)
            self.busy_s += time.perf_counter() - started
        elif isinstance(message, Connect):
            if message.downstream:
                self._connect(message.downstream)
            self.upstream = message.upstream
            send(self.head, Ready(self.ident))
        elif isinstance(message, Upstream):
            self.upstream = message.upstream
            send(self.head, Ready(self.ident))
        elif isinstance(message, SendReplay):
            self._connect(message.downstream)
            self._send_replay(message)
        elif isinstance(message, ReplayDone):
            send(self.head, Replayed(self.ident, message.count))
        elif isinstance(message, Ping):
            send(self.head, Pong(self.ident, message.nonce, self.busy_s))

    def _config(self, raw: str) -> EngineConfig:
        """The head's engine config, as this node runs it."""
        try:
            config = EngineConfig.from_json(raw)
        except (ValueError, TypeError) as error:
            raise BadFrame(f"invalid engine config: {error}") from None
        if config.num_threads and not self.num_threads:
            torch.set_num_threads(config.num_threads)
        return config

    @staticmethod
    def _checkpoint(config: EngineConfig) -> Checkpoint:
        """The model the config names, as this node runs it; BadFrame if this node cannot load it."""
        try:
            device = resolve_device(config)
            return load_checkpoint(
                config.model, resolve_dtype(config, device), config.cache_dir, keeps_quantized(config, device)
            )
        except (ValueError, OSError, TypeError) as error:
            raise BadFrame(f"cannot load the model {config.model!r}: {error}") from None

    def _probe(self, probe: Probe) -> None:
        config = self._config(probe.engine_config)
        reply = self._push(probe.head)
        profile = measure_node(config, self._checkpoint(config))
        send(reply, Profiled(probe.ident, profile))
        reply.close(linger=1000)
        log.info(
            "probed: %.2f ms per layer, %.1f GiB free", profile.seconds_per_layer * 1e3, profile.free_bytes / 2**30
        )

    def _setup(self, setup: Setup) -> None:
        config = self._config(setup.engine_config)
        if setup.first_layer >= setup.end_layer:
            raise BadFrame(f"Setup of no layers ({setup.first_layer} to {setup.end_layer})")
        if setup.wire_dtype != "auto" and setup.wire_dtype not in WIRE_DTYPES:
            raise BadFrame(f"Setup with wire dtype {setup.wire_dtype!r}, not auto or one of {sorted(WIRE_DTYPES)}")
        device = resolve_device(config)
        dtype = resolve_dtype(config, device)
        checkpoint = self._checkpoint(config)
        if setup.end_layer > checkpoint.config.num_layers:
            raise BadFrame(f"Setup of layers up to {setup.end_layer} of a model of {checkpoint.config.num_layers}")
        head = self._push(setup.head)
        model = build_model(
            config,
            checkpoint,
            device,
            dtype,
            layers=range(setup.first_layer, setup.end_layer),
            kv_groups=pipeline_kv_groups(checkpoint.config),
        )
        self.runner = ModelRunner(model, setup.num_blocks, config.block_size)
        self.ident, self.upstream, self.stage = setup.ident, setup.upstream, setup.stage
        self.is_last = model.has_head
        self.wire = wire_dtype(setup.wire_dtype, dtype)
        self.log = BoundaryLog(
            setup.num_blocks * config.block_size, model.config.hidden_size, self.wire, config.block_size
        )
        for sock in (self.head, self.downstream):  # a persistent server's previous head
            if sock is not None:
                sock.close(linger=0)
        self.head, self.downstream = head, None
        if setup.downstream:
            self._connect(setup.downstream)
        log.info(
            "%s layers %d-%d (stage %d)",
            "holds" if setup.downstream else "holds, as a spare,",
            setup.first_layer,
            setup.end_layer - 1,
            setup.stage,
        )
        send(self.head, Ready(setup.ident))

    def _step(self, step: Step, hidden: torch.Tensor) -> None:
        step.batch.check(self.runner.num_blocks, self.runner.block_size, self.runner.model.kv_groups.count)
        expected = (len(step.batch.positions), self.runner.model.config.hidden_size)
        if tuple(hidden.shape) != expected:
            raise BadFrame(f"Step {step.step_id} has hidden states of shape {list(hidden.shape)}, not {list(expected)}")
        batch = step_batch(step.batch)
        started = time.time_ns()
        hidden = self.runner.run_layers(batch, hidden.to(self.runner.model.device))
        if self.is_last:
            if not step.replay:
                logits = self.runner.logits(batch, hidden)
                times = (*step.stage_times, (self.stage, started, time.time_ns()))
                send(self.head, Logits(step.step_id, self.ident, times), logits)
            return
        outgoing = hidden.to(self.wire).cpu()
        self.log.record(batch, outgoing)
        if not step.replay:
            times = (*step.stage_times, (self.stage, started, time.time_ns()))
            send(self.downstream, Step(step.step_id, step.batch, self.ident, stage_times=times), outgoing)

    def _connect(self, address: str) -> None:
        downstream = self._push(address)
        if self.downstream is not None:
            self.downstream.close(linger=0)
        self.downstream = downstream

    def _send_replay(self, request: SendReplay) -> None:
        num_blocks, block_size = self.runner.num_blocks, self.runner.block_size
        for table, tokens in request.sequences:
            if tokens > len(table) * block_size or any(block >= num_blocks for block in table):
                raise BadFrame(f"SendReplay of a sequence beyond its block table or this stage's {num_blocks} blocks")
        for table, tokens in request.sequences:
            batch, rows = self.log.replay(table, tokens)
            send(self.downstream, Step(-1, batch_frame(batch), self.ident, replay=True), rows)
        send(self.downstream, ReplayDone(len(request.sequences), self.ident))


def serve_stage(bind: str, persistent: bool = False, num_threads: int | None = None) -> None:
    """Runs a stage server until SIGTERM, or until its head sends Stop unless `persistent`. It
    needs the cluster secret (its head hands it to the stage processes it starts)."""
    try:
        secret = required_secret("a pipeline stage server")
    except MissingClusterSecret as error:
        raise SystemExit(f"shoal stage: {error}") from None
    signal.signal(signal.SIGTERM, lambda *_: os._exit(0))
    StageServer(bind, secret, num_threads).serve(persistent)


def main() -> None:
    parser = argparse.ArgumentParser(description="A pipeline stage (its head sends it the layers to hold).")
    parser.add_argument("--bind", required=True, help="ZeroMQ address of this stage's inbox")
    args = parser.parse_args()
    configure_logging()
    serve_stage(args.bind)


if __name__ == "__main__":
    main()
