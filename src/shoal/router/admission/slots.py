"""How many requests of each model hold an admission slot: in one router process (LocalSlots), or
across the processes of a router group (GroupSlots), so that max_in_flight_per_worker holds for
the group as a whole and not once per process.

GroupSlots is a file the group's parent creates in its private directory, mapped by every member:
a table of models (by a hash of the name), then one row of counts per member. A member changes only its own row, and
takes a slot under an exclusive flock, so two members never both take the last one. flock is
released by the kernel when a holder dies, so a member killed at any point cannot wedge the
others; the parent zeroes a dead member's row before starting it again (its slots died with it).
Invariant: the sum of a model's column is the number of its requests holding a slot in the group.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
from collections import Counter
from pathlib import Path

import numpy as np

MAX_MODELS = 256
KEY_BYTES = 16  # each model's entry: 1 (taken), then a hash of its name


class LocalSlots:
    def __init__(self):
        self._held: Counter[str] = Counter()

    def try_take(self, model: str, capacity: int) -> bool:
        if self._held[model] >= capacity:
            return False
        self._held[model] += 1
        return True

    def take(self, model: str) -> None:
        """Takes a slot whatever the capacity (a request moved to a fallback model with room)."""
        self._held[model] += 1

    def give_back(self, model: str) -> None:
        self._held[model] -= 1

    def held(self, model: str) -> int:
        return self._held[model]

    def total(self) -> int:
        return sum(self._held.values())


class GroupSlots:
    def __init__(self, path: Path, member: int | None, members: int):
        """`member` None: the group's parent, which only clears rows."""
        self.member = member
        self._fd = os.open(path, os.O_RDWR)
        size = MAX_MODELS * KEY_BYTES + members * MAX_MODELS * 8
        self._map = mmap.mmap(self._fd, size)
        self._keys = np.frombuffer(self._map, dtype=np.uint8, count=MAX_MODELS * KEY_BYTES).reshape(
            MAX_MODELS, KEY_BYTES
        )
        self._counts = np.frombuffer(
            self._map, dtype=np.int64, count=members * MAX_MODELS, offset=MAX_MODELS * KEY_BYTES
        ).reshape(members, MAX_MODELS)
        self._columns: dict[str, int] = {}

    @staticmethod
    def create(path: Path, members: int) -> None:
        """The zeroed file for a group of `members` (only the owner may open it)."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.ftruncate(fd, MAX_MODELS * KEY_BYTES + members * MAX_MODELS * 8)
        finally:
            os.close(fd)

    def try_take(self, model: str, capacity: int) -> bool:
        column = self._column(model)
        with self._locked():
            if int(self._counts[:, column].sum()) >= capacity:
                return False
            self._counts[self.member, column] += 1
            return True

    def take(self, model: str) -> None:
        column = self._column(model)
        with self._locked():
            self._counts[self.member, column] += 1

    def give_back(self, model: str) -> None:
        column = self._column(model)
        with self._locked():
            self._counts[self.member, column] -= 1

    def held(self, model: str) -> int:
        return int(self._counts[:, self._column(model)].sum())

    def total(self) -> int:
        return int(self._counts.sum())

    def clear(self, member: int) -> None:
        """Zeroes a member's row: its slots went with it."""
        with self._locked():
            self._counts[member, :] = 0

    def _column(self, model: str) -> int:
        column = self._columns.get(model)
        if column is not None:
            return column
        key = b"\x01" + hashlib.blake2b(model.encode(), digest_size=KEY_BYTES - 1).digest()
        with self._locked():
            for column in range(MAX_MODELS):
                entry = self._keys[column].tobytes()
                if entry == key:
                    break
                if entry[0] == 0:  # free: this model is new to the group
                    self._keys[column] = np.frombuffer(key, dtype=np.uint8)
                    break
            else:
                raise ValueError(f"a router group admits at most {MAX_MODELS} models")
        self._columns[model] = column
        return column

    @contextlib.contextmanager
    def _locked(self):
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
