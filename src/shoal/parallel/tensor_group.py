"""A tensor-parallel replica's processes: rank 0 runs the engine, ranks 1..n-1 follow.

Rank 0 starts the followers as child processes on this host (they die with it). The ranks meet in
the layers' explicit gathers: on CPUs through a shared-memory file only this user can open
(shared_memory_group: no socket, nothing deserialized), on CUDA in an NCCL process group whose
rendezvous is a file store in a private directory (NCCL's own bootstrap connects the ranks over
loopback). Gathers time out after `COLLECTIVE_TIMEOUT_S`, so a hung rank fails the step rather
than the replica hanging forever. Each step's batch goes to every follower over its own ZeroMQ
socket (typed frames, see protocol.tensor_group_frames; CURVE with the cluster secret, see
cluster_sockets, so no other process can connect to rank 0's sockets, and a secret drawn for the
run when none is configured reaches the followers in their environment). Step batches travel by
message rather than by collective so that an idle replica has no collective waiting to time out.
A follower that receives a frame it cannot decode exits, which fails the group at once.

The group is one failure domain: when any follower exits, the group is failed, the others are
killed (so no collective waits on them), `on_failure` is called (a worker exits so that its
supervisor restarts the replica as a whole, and the router moves its streams), and every later
step raises ReplicaFailedError.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import timedelta

import torch
import torch.distributed as dist
import zmq

from shoal.config.engine import EngineConfig
from shoal.errors import ReplicaFailedError
from shoal.model.loader import load_checkpoint
from shoal.model.sharding import TensorParallel
from shoal.parallel.cluster_sockets import ClusterContext
from shoal.parallel.shared_memory_group import SharedMemoryGroup
from shoal.parallel.stage_messages import batch_frame, step_batch
from shoal.processes import die_with_parent
from shoal.protocol.cluster_secret import child_environment, required_secret, run_secret
from shoal.protocol.frames import BadFrame
from shoal.protocol.tensor_group_frames import (
    Adapters,
    Begin,
    Finish,
    GroupFrame,
    NamedAdapter,
    RunBatch,
    decode,
    encode,
)
from shoal.runner.devices import keeps_quantized, resolve_device, resolve_dtype
from shoal.runner.model_runner import ModelRunner, build_model, lora_registry
from shoal.runner.step_batch import StepBatch

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 60.0
START_TIMEOUT_S = 300.0


# Each rank's slot in the shared-memory gathers; larger activations go through in row chunks.
SLOT_BYTES = 8 << 20


class NcclGroup:
    """The ranks' gathers on CUDA: an NCCL process group (one GPU per rank), rendezvous through a
    file store at `store_path`; NCCL's own timeout ends a wait on a lost rank (written for CUDA; no
    GPU was at hand to run it in the suite)."""

    def __init__(self, rank: int, size: int, store_path: str, device: torch.device):
        torch.cuda.set_device(device)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        self.size = size
        self.group = dist.ProcessGroupNCCL(dist.FileStore(store_path, size), rank, size, options)

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        self.group.allgather([parts], [tensor.contiguous()]).wait()
        return parts


def gathers(rank: int, size: int, links: SharedMemoryGroup, store_path: str, device: torch.device):
    """The gathers this rank's shard uses: the shared memory on CPUs, NCCL on CUDA."""
    return links if device.type == "cpu" else NcclGroup(rank, size, store_path, device)


def threads_per_rank(config: EngineConfig) -> int:
    """CPU threads for each rank: as configured, else the cores shared out between the ranks."""
    return config.num_threads or max(1, torch.get_num_threads() // config.tensor_parallel_size)


class TensorParallelGroup:
    """Rank 0's handle on the group. Invariant: while not failed, every follower is alive and has
    received every batch rank 0 has run."""

    def __init__(self, config: EngineConfig, on_failure: Callable[[str], None] | None = None):
        self.size = config.tensor_parallel_size
        self.on_failure = on_failure
        self.failure: str | None = None
        secret = run_secret()
        self._context = ClusterContext(secret)
        self._sockets = []
        self.followers: list[subprocess.Popen] = []
        device = resolve_device(config, 0)
        config = dataclasses.replace(config, num_threads=threads_per_rank(config))
        torch.set_num_threads(config.num_threads)
        self.links = SharedMemoryGroup.create(self.size, SLOT_BYTES, COLLECTIVE_TIMEOUT_S)
        self._store_directory = tempfile.TemporaryDirectory(prefix="shoal-tensor-parallel-")
        store_path = os.path.join(self._store_directory.name, "store")
        for rank in range(1, self.size):
            sock, address = self._context.bind_to_random_port(zmq.PUSH, "127.0.0.1")
            self._sockets.append(sock)
            self.followers.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "shoal.parallel.tensor_group",
                        "--rank",
                        str(rank),
                        "--shared-memory",
                        self.links.path,
                        "--store",
                        store_path,
                        "--steps",
                        address,
                        "--config",
                        config.to_json(),
                    ],
                    env=child_environment(secret),
                    preexec_fn=die_with_parent,
                )
            )
        self._await_followers()
        self.links.unlink()
        self.context = TensorParallel(
            0, self.size, gathers(0, self.size, self.links, store_path, device), config.enable_expert_parallel
        )
        threading.Thread(target=self._watch, name="tensor-parallel-watch", daemon=True).start()

    def _await_followers(self) -> None:
        """Returns once every follower is about to join; a follower that exits first, or none
        joining within START_TIMEOUT_S, fails the group at once."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while not self.links.joined():
            exited = [(rank, p.returncode) for rank, p in enumerate(self.followers, 1) if p.poll() is not None]
            if exited or time.monotonic() > deadline:
                reason = (
                    f"tensor-parallel rank {exited[0][0]} exited with status {exited[0][1]} before joining"
                    if exited
                    else f"the tensor-parallel ranks did not join within {START_TIMEOUT_S:.0f} s"
                )
                self.failure = reason
                for process in self.followers:
                    process.kill()
                self.shutdown()
                raise ReplicaFailedError(reason)
            time.sleep(0.05)

    def begin(self, num_blocks: int) -> None:
        """Tells the followers how many KV blocks to allocate (rank 0's budget decides for all)."""
        self._send(Begin(num_blocks))

    def send(self, batch: StepBatch) -> None:
        if self.failure:
            raise ReplicaFailedError(self.failure)
        self._send(RunBatch(batch_frame(batch)))

    def tell(self, adapters: Adapters) -> None:
        """The LoRA adapters the next batches may run (each follower reads them from their paths)."""
        if self.failure:
            raise ReplicaFailedError(self.failure)
        self._send(adapters)

    def _send(self, message: GroupFrame) -> None:
        payload = encode(message)
        for sock in self._sockets:
            sock.send(payload)

    def _watch(self) -> None:
        while self.failure is None:
            for rank, process in enumerate(self.followers, start=1):
                if process.poll() is not None and self.failure is None:
                    self._fail(f"tensor-parallel rank {rank} exited with status {process.returncode}")
            time.sleep(0.1)

    def _fail(self, reason: str) -> None:
        self.failure = reason
        self.links.abort(reason)
        log.error("%s; the replica fails as a whole", reason)
        for process in self.followers:
            if process.poll() is None:
                process.kill()
        if self.on_failure is not None:
            self.on_failure(reason)

    def shutdown(self) -> None:
        """Stops the followers (they finish the batch in hand first)."""
        if self.failure is None:
            self.failure = "shut down"
            self._send(Finish())
        for process in self.followers:
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._context.close()
        self.links.unlink()
        self.links.close()
        self._store_directory.cleanup()


class TensorParallelRunner(ModelRunner):
    """Rank 0's runner: each batch goes to the followers, then through this rank's shard. Invariant:
    before a batch, every follower has been told each LoRA adapter it runs, with the files rank 0
    holds for that name now."""

    def __init__(self, group: TensorParallelGroup, model, num_blocks: int, block_size: int, loras=None):
        super().__init__(model, num_blocks, block_size, loras)
        self.group = group
        self._told: dict[str, str] = {}  # adapter name -> the SHA-256 the followers were told
        group.begin(num_blocks)

    def shutdown(self) -> None:
        self.group.shutdown()

    def run(self, batch: StepBatch) -> torch.Tensor:
        self._tell_adapters(batch)
        self.group.send(batch)
        try:
            return super().run(batch)
        except RuntimeError as exc:  # a collective failed: some rank is gone or hung
            raise ReplicaFailedError(self.group.failure or f"a tensor-parallel collective failed: {exc}") from exc

    def _tell_adapters(self, batch: StepBatch) -> None:
        news = []
        for name in {name for name in batch.lora_names if name is not None}:
            known = self.loras.known.get(name) or self.loras.retiring[name]
            if self._told.get(name) != known.digest:
                news.append(NamedAdapter(name, known.path, known.digest))
                self._told[name] = known.digest
        if news:
            self.group.tell(Adapters(sorted(news, key=lambda adapter: adapter.name)))


def follow(rank: int, shared_memory: str, store_path: str, steps: str, config: EngineConfig, secret: str) -> None:
    """A follower's life: load its shard, join the group, then run every batch rank 0 sends, until
    it sends Finish. A frame that is not the next message expected ends it (SystemExit)."""
    device = resolve_device(config, rank)
    torch.set_num_threads(config.num_threads)
    dtype = resolve_dtype(config, device)
    checkpoint = load_checkpoint(config.model, dtype, config.cache_dir, keeps_quantized(config, device))
    sock = ClusterContext(secret).connect(zmq.PULL, steps)
    size = config.tensor_parallel_size
    links = SharedMemoryGroup(shared_memory, rank, size, SLOT_BYTES, COLLECTIVE_TIMEOUT_S)
    links.join()
    tp = TensorParallel(rank, size, gathers(rank, size, links, store_path, device), config.enable_expert_parallel)
    model = build_model(config, checkpoint, device, dtype, tensor_parallel=tp)
    loras = lora_registry(config, checkpoint, dtype, device, tp)
    try:
        begin = _expect(sock, Begin)
        runner = ModelRunner(model, begin.num_blocks, config.block_size, loras)
        while not isinstance(message := _expect(sock, RunBatch | Adapters | Finish), Finish):
            if isinstance(message, Adapters):
                if loras is None:
                    raise BadFrame("LoRA adapters told to a rank that serves none")
                for adapter in message.adapters:
                    loras.know(adapter.name, adapter.path, adapter.sha256)
                continue
            message.batch.check(begin.num_blocks, config.block_size, model.kv_groups.count)
            runner.run(step_batch(message.batch))
    except BadFrame as error:
        raise SystemExit(f"tensor-parallel rank {rank}: bad message from rank 0: {error}") from None


def _expect(sock: zmq.Socket, kind: type) -> GroupFrame:
    """The next message from rank 0; BadFrame unless it is one of `kind`."""
    message = decode(sock.recv())
    if not isinstance(message, kind):
        raise BadFrame(f"{type(message).__name__} out of order")
    return message


def main() -> None:
    parser = argparse.ArgumentParser(description="A tensor-parallel follower rank (started by rank 0).")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--shared-memory", required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--steps", required=True)
    parser.add_argument("--config", required=True)
    args = parser.parse_args()
    follow(
        args.rank,
        args.shared_memory,
        args.store,
        args.steps,
        EngineConfig.from_json(args.config),
        required_secret("a tensor-parallel follower"),
    )


if __name__ == "__main__":
    main()
