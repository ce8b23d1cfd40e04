"""All-gathers between the tensor-parallel ranks of one host, through shared memory.

A tensor-parallel replica's processes are one failure domain on one host, so their collectives need
no network: rank 0 creates a file in /dev/shm that only this user can open (mode 0600), the
followers it starts map it by name, and rank 0 unlinks it once they have. Nothing listens on a
socket, so no other host and no other user's process can take part, and nothing is deserialized:
every rank reads raw bytes of a shape and dtype it knows from the model.

Layout: one 64-byte line per rank (the generation it last published, and whether it has joined),
then two buffers of one slot per rank, used by alternate generations.

Every rank calls the gathers in the same order with the same shapes (the model's layers do). For
generation g a rank writes its part into its slot of buffer g % 2, publishes g, waits until every
rank has published g, and reads every slot. A rank publishes g + 1 only after it has read g, so a
buffer is written again (at g + 2) only after every rank has read it. A tensor larger than a slot
goes through in chunks of rows, one generation each.

Waits spin briefly where every rank has a core of its own, then yield the CPU, then sleep in short
naps (ranks that share cores must not keep the one that is late from running); they raise
RuntimeError after `timeout_s`, or at once after abort() (rank 0 calls it when a follower dies),
which fails the step and with it the replica.
"""

from __future__ import annotations

import math
import mmap
import os
import tempfile
import time

import numpy as np
import torch

LINE_WORDS = 8  # int64 words per rank line (64 bytes)
HOT_SPINS = 2000  # checks before the first yield, where every rank has a core
YIELDS = 50  # yields before napping
NAP_S = 20e-6


class SharedMemoryGroup:
    """One rank's view of the group's shared file. Invariant: `generation` is the last generation
    this rank published; every other rank has published at least generation - 1."""

    def __init__(self, path: str, rank: int, size: int, slot_bytes: int, timeout_s: float):
        self.path, self.rank, self.size, self.slot_bytes, self.timeout_s = path, rank, size, slot_bytes, timeout_s
        with open(path, "r+b") as file:
            self._map = mmap.mmap(file.fileno(), self.file_bytes(size, slot_bytes))
        self._lines = np.frombuffer(self._map, dtype=np.int64, count=size * LINE_WORDS).reshape(size, LINE_WORDS)
        self._slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=size * LINE_WORDS * 8).view(
            2, size, slot_bytes
        )
        self.generation = 0
        self.aborted: str | None = None
        self.hot_spins = HOT_SPINS if size <= len(os.sched_getaffinity(0)) else 0

    @staticmethod
    def file_bytes(size: int, slot_bytes: int) -> int:
        return size * LINE_WORDS * 8 + 2 * size * slot_bytes

    @classmethod
    def create(cls, size: int, slot_bytes: int, timeout_s: float) -> SharedMemoryGroup:
        """Rank 0's group: a new zeroed file in /dev/shm (or the temporary directory), mode 0600."""
        directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
        handle, path = tempfile.mkstemp(prefix="shoal-tensor-parallel-", dir=directory)
        try:
            os.ftruncate(handle, cls.file_bytes(size, slot_bytes))
        finally:
            os.close(handle)
        return cls(path, 0, size, slot_bytes, timeout_s)

    def join(self) -> None:
        """A follower: announces that its shard is loaded and it is about to gather."""
        self._lines[self.rank, 1] = 1

    def joined(self) -> bool:
        """Whether every follower has joined."""
        return bool(self._lines[1:, 1].all())

    def unlink(self) -> None:
        """Removes the file's name (the mappings stay): once every rank has mapped it."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def abort(self, reason: str) -> None:
        """From any thread: a wait in progress, and every later one, raises RuntimeError."""
        self.aborted = reason

    def all_gather(self, tensor: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `tensor` (same shape and dtype on all, at least one dimension), in rank order."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        row_bytes = max(1, math.prod(tensor.shape[1:]) * tensor.element_size())
        if row_bytes > self.slot_bytes:
            raise ValueError(f"a row of {row_bytes} bytes exceeds the {self.slot_bytes}-byte slots")
        step = self.slot_bytes // row_bytes
        rows = tensor.reshape(tensor.shape[0], math.prod(tensor.shape[1:]))
        outs = [p.reshape(rows.shape) for p in parts]
        for start in range(0, max(rows.shape[0], 1), step):
            chunk = rows[start : start + step]
            count = chunk.numel() * chunk.element_size()
            buffer = self._slots[(self.generation + 1) % 2]
            buffer[self.rank, :count].copy_(chunk.reshape(-1).view(torch.uint8))
            self._publish_and_wait()
            for r, out in enumerate(outs):
                out[start : start + step].reshape(-1).view(torch.uint8).copy_(buffer[r, :count])
        return parts

    def _publish_and_wait(self) -> None:
        self.generation += 1
        self._lines[self.rank, 0] = self.generation
        published = self._lines[:, 0]
        checks, deadline = 0, None
        while published.min() < self.generation:
            if self.aborted:
                raise RuntimeError(f"tensor-parallel gather abandoned: {self.aborted}")
            checks += 1
            if checks < self.hot_spins:
                continue
            now = time.monotonic()
            if deadline is None:
                deadline = now + self.timeout_s
            elif now > deadline:
                late = f"a tensor-parallel rank did not reach gather {self.generation} in {self.timeout_s} s"
                raise RuntimeError(late)
            if checks < self.hot_spins + YIELDS:
                os.sched_yield()
            else:
                time.sleep(NAP_S)

    def close(self) -> None:
        """Unmaps the file (views still held elsewhere keep it mapped until they go)."""
        self._lines = self._slots = None
        try:
            self._map.close()
        except BufferError:
            pass
