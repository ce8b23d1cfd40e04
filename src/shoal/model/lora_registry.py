"""The LoRA adapters an engine serves: those it knows by name (where their files are), and those it
holds in memory, packed for its model, at most `max_cpu_loras`, the least recently used given back
first (and read again from their files when next asked for). Reading a file (`read`) may run on any
thread; everything that changes what is known or held runs on the engine's thread."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shoal.errors import InvalidRequestError, ModelNotFoundError
from shoal.model.config import LlamaConfig
from shoal.model.lora_adapter import AdapterFiles, LoraAdapter, peft_adapter, read_peft_files
from shoal.model.lora_batch import PackedAdapter
from shoal.model.lora_gguf import GgufLoraFiles, gguf_adapter, read_gguf_lora

Files = AdapterFiles | GgufLoraFiles  # an adapter's files as read, before torch sees them


@dataclass(frozen=True)
class KnownAdapter:
    path: str
    sha256: str | None
    digest: str  # the SHA-256 of its weights when it was first read


@dataclass(frozen=True)
class LoraCounters:
    """What the registry serves, for load reports and metrics: adapters known by name, those held in
    memory (least recently used first), files read since start and a read's recent seconds."""

    known: tuple[str, ...]
    held: tuple[str, ...]
    loads: int
    load_s: float | None


class LoraRegistry:
    """Invariants: `held` has at most max_cpu_loras adapters, least recently used first, each one
    known or retiring; a known adapter was read and checked against the model once (so it can be
    read again). A retiring adapter was unloaded while requests ran it: new requests cannot name
    it, the running ones keep it until they end (`retire`)."""

    def __init__(
        self,
        model_config: LlamaConfig,
        max_rank: int,
        max_cpu_loras: int,
        dtype: torch.dtype,
        device: torch.device,
        tile_rows: int,
        prepack: bool,
        shard: Callable[[LoraAdapter], LoraAdapter] | None = None,
    ):
        """`model_config`: the whole model's (adapters are checked against it); `shard`: this
        tensor-parallel rank's part of an adapter (sharding.shard_adapter), None in one process."""
        self.model_config = model_config
        self.max_rank = max_rank
        self.max_cpu_loras = max_cpu_loras
        self._packing = (dtype, device, tile_rows, prepack)
        self._shard = shard
        self.known: dict[str, KnownAdapter] = {}
        self.retiring: dict[str, KnownAdapter] = {}
        self.held: OrderedDict[str, PackedAdapter] = OrderedDict()
        self.loads = 0  # adapters read from their files, first reads and reads after eviction
        self.load_s: float | None = None  # recent reads' seconds (read, checked and packed), smoothed

    @staticmethod
    def read(path: str, sha256: str | None) -> tuple[Files, float]:
        """An adapter's files read from disk (a PEFT directory, or a llama.cpp LoRA GGUF), and the
        seconds it took; any thread (no torch, and it changes nothing here). LoraAdapterError names
        the file and why."""
        started = time.perf_counter()
        reader = read_gguf_lora if path.endswith(".gguf") else read_peft_files
        return reader(path, sha256), time.perf_counter() - started

    def admit(self, name: str, path: str, sha256: str | None, files: Files, read_s: float) -> None:
        """Checks the adapter `files` hold against the model and holds it, known by `name`
        (LoraAdapterError names the file and why); InvalidRequestError when the name is taken by
        another adapter."""
        known = self.known.get(name)
        if known is not None and (known.path, known.sha256) != (path, sha256):
            raise InvalidRequestError(
                f"a LoRA adapter named {name!r} is already loaded from {known.path}", param="lora_name"
            )
        packed = self._pack(name, files, read_s)
        self.known[name] = KnownAdapter(path, sha256, files.digest)
        self._hold(name, packed)

    def refill(self, name: str, files: Files, read_s: float) -> None:
        """Holds again the adapter of a known (or retiring) name it had given back, from its files
        read again; a name unloaded since, or whose files changed, is left alone."""
        known = self.known.get(name) or self.retiring.get(name)
        if known is not None and known.digest == files.digest and name not in self.held:
            self._hold(name, self._pack(name, files, read_s))

    def counters(self) -> LoraCounters:
        return LoraCounters(tuple(sorted(self.known)), tuple(self.held), self.loads, self.load_s)

    def source(self, name: str) -> KnownAdapter | None:
        """Where a known adapter that is not held now is read from again; None for one held or not known."""
        return None if name in self.held else self.known.get(name)

    def register(self, name: str, path: str, sha256: str | None = None) -> None:
        """Reads and checks the adapter now (LoraAdapterError names the file and why) and holds it;
        InvalidRequestError when the name is taken by another adapter."""
        self.admit(name, path, sha256, *self.read(path, sha256))

    def know(self, name: str, path: str, digest: str) -> None:
        """Knows an adapter by name without reading it (a tensor-parallel follower told by rank 0,
        which read and checked it); it is read, and its SHA-256 checked, when a step first needs it.
        Other files for a known name replace the ones held."""
        known = self.known.get(name)
        if known is not None and known.digest != digest:
            self.held.pop(name, None)
        self.known[name] = KnownAdapter(path, None, digest)

    def unregister(self, name: str, running: bool) -> None:
        """Forgets the adapter for new requests; `running`: requests still run it, and keep it
        until `retire` says they ended. ModelNotFoundError for a name not known."""
        known = self.known.pop(name, None)
        if known is None:
            raise ModelNotFoundError(f"no LoRA adapter named {name!r} is loaded", param="lora_name")
        if running:
            self.retiring[name] = known
        else:
            self.held.pop(name, None)

    def retire(self, running: set[str | None]) -> None:
        """Gives back the retiring adapters no request in `running` runs any more."""
        for name in [n for n in self.retiring if n not in running]:
            del self.retiring[name]
            self.held.pop(name, None)

    def check(self, name: str) -> None:
        """ModelNotFoundError unless new requests may name the adapter."""
        if name not in self.known:
            raise ModelNotFoundError(f"the model {name!r} does not exist", param="model")

    def adapter(self, name: str) -> PackedAdapter:
        """The held adapter (now the most recently used), read again if it was given back."""
        packed = self.held.get(name)
        if packed is None:
            known = self.known.get(name) or self.retiring[name]
            packed = self._read(name, known.path, known.digest)
            self._hold(name, packed)
        self.held.move_to_end(name)
        return packed

    def salt(self, name: str) -> bytes:
        """What sets the adapter's KV apart in the prefix cache: its weights' digest."""
        return bytes.fromhex((self.known.get(name) or self.retiring[name]).digest)[:16]

    def _read(self, name: str, path: str, sha256: str | None) -> PackedAdapter:
        return self._pack(name, *self.read(path, sha256))

    def _pack(self, name: str, files: Files, read_s: float) -> PackedAdapter:
        started = time.perf_counter()
        make = gguf_adapter if isinstance(files, GgufLoraFiles) else peft_adapter
        adapter = make(name, files, self.model_config, self.max_rank)
        packed = PackedAdapter(self._shard(adapter) if self._shard else adapter, *self._packing)
        seconds = read_s + time.perf_counter() - started
        self.load_s = seconds if self.load_s is None else 0.7 * self.load_s + 0.3 * seconds
        self.loads += 1
        return packed

    def _hold(self, name: str, packed: PackedAdapter) -> None:
        self.held[name] = packed
        self.held.move_to_end(name)
        while len(self.held) > self.max_cpu_loras:
            self.held.popitem(last=False)
