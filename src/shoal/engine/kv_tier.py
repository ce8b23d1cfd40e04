"""A KV tier below the paged cache: blocks the paged cache evicts are kept in host memory, then in a
memory-mapped file on local disk, and a prefix found there is copied back instead of recomputed.

Blocks are content-addressed by their chained hash (shoal.engine.block_manager), so a block is valid
wherever it is found, for any request, in any engine of the same layout. Levels:
- `host`: an LRU of up to host_bytes of blocks in this process's memory. On a GPU this is the
  offload target; on a CPU it stretches the paged cache at a lower priority.
- `disk`: a file of fixed-size slots under `directory`, up to disk_bytes, LRU; host evictions land
  here. The file survives the process: each slot stores its block's hash after its data (cleared
  first while a slot is rewritten), so a restarted worker rebuilds the index from the file. The
  file's header names the layout; a file of another layout is started afresh. Each engine holds an
  exclusive lock on the file it uses (the first of tier-0.kv, tier-1.kv, ... it can lock), so
  workers of one host never write each other's slots.
- `shared` (with `shared`): the tier files of the other engines in the same directory, read only.
  A block one of them holds on disk is found here too, so the workers of a host share a KV tier
  (and those of a cluster, where the directory is on a shared file system). Reads use pread, never
  a mapping a writer could cut short, and check that the slot still holds the hash (found by the
  last scan) after copying its data: a slot being rewritten then is a miss, not a torn block. The
  files' slot hashes are scanned again on a miss, at most once every SHARED_RESCAN_S.

Counters: hits and misses (blocks looked up below the paged cache) and evictions, by level.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import mmap
import os
import time
from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from shoal.config.engine import EngineConfig
from shoal.engine.kv_event_log import KvEventLog
from shoal.engine.kv_layout import KVLayout
from shoal.model.weight_cache import default_cache_dir
from shoal.protocol.kv_events import DISK, HOST

log = logging.getLogger(__name__)

DIGEST_BYTES = 16
HEADER_BYTES = 4096
MAX_TIER_FILES = 64
LEVELS = ("host", "disk", "shared")
SHARED_RESCAN_S = 1.0


class DiskTier:
    """Invariant: `index` maps each valid slot's hash to the slot; a slot is in at most one of
    `index` and `free`; the file's slot i holds [data | digest] with the digest zeroed while the
    data is rewritten."""

    def __init__(self, directory: Path, layout: KVLayout, slot_bytes: int, capacity_bytes: int):
        self.slot_bytes = slot_bytes
        self.stride = slot_bytes + DIGEST_BYTES
        self.slots = max(1, capacity_bytes // self.stride)
        directory.mkdir(parents=True, exist_ok=True)
        signature = json.dumps({**asdict(layout), "slot_bytes": slot_bytes, "slots": self.slots}, sort_keys=True)
        self.handle, self.path = _lock_a_file(directory)
        size = HEADER_BYTES + self.slots * self.stride
        fresh = _header(self.handle) != signature
        if fresh:
            self.handle.truncate(0)
        self.handle.truncate(size)
        self.map = mmap.mmap(self.handle.fileno(), size)
        self.index: OrderedDict[bytes, int] = OrderedDict()
        if fresh:
            encoded = signature.encode()
            self.map[: len(encoded) + 1] = encoded + b"\n"
        else:
            for slot in range(self.slots):
                digest = bytes(self._digest_view(slot))
                if digest != bytes(DIGEST_BYTES):
                    self.index[digest] = slot
        self.free = [slot for slot in range(self.slots) if slot not in set(self.index.values())]
        log.info("KV tier on disk: %s, %d slots, %d blocks kept from before", self.path, self.slots, len(self.index))

    def _digest_view(self, slot: int) -> memoryview:
        start = HEADER_BYTES + slot * self.stride + self.slot_bytes
        return memoryview(self.map)[start : start + DIGEST_BYTES]

    def put(self, digest: bytes, data: torch.Tensor) -> bool:
        """Stores a block (its bytes as a uint8 tensor); True if it evicted another to make room."""
        if digest in self.index:
            self.index.move_to_end(digest)
            return False
        evicted = not self.free
        slot = self.index.popitem(last=False)[1] if evicted else self.free.pop()
        start = HEADER_BYTES + slot * self.stride
        self._digest_view(slot)[:] = bytes(DIGEST_BYTES)
        self.map[start : start + self.slot_bytes] = data.numpy().tobytes()
        self._digest_view(slot)[:] = digest
        self.index[digest] = slot
        return evicted

    def get(self, digest: bytes) -> torch.Tensor | None:
        slot = self.index.get(digest)
        if slot is None:
            return None
        self.index.move_to_end(digest)
        start = HEADER_BYTES + slot * self.stride
        return torch.frombuffer(bytearray(memoryview(self.map)[start : start + self.slot_bytes]), dtype=torch.uint8)

    def close(self) -> None:
        self.map.flush()
        self.map.close()
        self.handle.close()


class SharedTierFiles:
    """Read-only views of other engines' tier files in one directory. Invariant: `index` maps a
    hash to (file descriptor, slot) where that slot held it at the last scan."""

    def __init__(self, directory: Path, own: Path, layout: KVLayout, slot_bytes: int):
        self.directory, self.own, self.slot_bytes = directory, own, slot_bytes
        self.stride = slot_bytes + DIGEST_BYTES
        self.expected = {**asdict(layout), "slot_bytes": slot_bytes}
        self.descriptors: dict[Path, int] = {}
        self.index: dict[bytes, tuple[int, int]] = {}
        self.scanned = float("-inf")

    def get(self, digest: bytes) -> torch.Tensor | None:
        found = self.index.get(digest)
        if found is None and time.monotonic() - self.scanned >= SHARED_RESCAN_S:
            self._scan()
            found = self.index.get(digest)
        if found is None:
            return None
        descriptor, slot = found
        start = HEADER_BYTES + slot * self.stride
        data = bytearray(self.slot_bytes)
        read = os.preadv(descriptor, [data], start)
        after = os.pread(descriptor, DIGEST_BYTES, start + self.slot_bytes)
        if read != self.slot_bytes or after != digest:  # rewritten (or cut) meanwhile
            del self.index[digest]
            return None
        return torch.frombuffer(data, dtype=torch.uint8)

    def _scan(self) -> None:
        self.scanned = time.monotonic()
        self.index.clear()
        for path in sorted(self.directory.glob("tier-*.kv")):
            if path == self.own:
                continue
            descriptor = self.descriptors.get(path)
            if descriptor is None:
                descriptor = self.descriptors[path] = os.open(path, os.O_RDONLY)
            slots = self._slots(descriptor)
            for slot in range(slots):
                digest = os.pread(descriptor, DIGEST_BYTES, HEADER_BYTES + slot * self.stride + self.slot_bytes)
                if len(digest) == DIGEST_BYTES and digest != bytes(DIGEST_BYTES):
                    self.index[digest] = (descriptor, slot)

    def _slots(self, descriptor: int) -> int:
        """The slots of a file of this layout (0 for any other, or a file being set up)."""
        try:
            header = json.loads(os.pread(descriptor, HEADER_BYTES, 0).split(b"\n", 1)[0])
        except ValueError:
            return 0
        slots = header.pop("slots", 0) if isinstance(header, dict) else 0
        return slots if header == self.expected and isinstance(slots, int) else 0

    def close(self) -> None:
        for descriptor in self.descriptors.values():
            os.close(descriptor)
        self.descriptors.clear()
        self.index.clear()


@dataclass(frozen=True)
class TierCounters:
    """Hits and evictions by level (host, disk), misses (blocks found in no level), blocks held."""

    hits: dict[str, int]
    misses: int
    evictions: dict[str, int]
    blocks: dict[str, int]
    capacity_tokens: int  # host and disk together
    load_tokens_per_s: float | None  # measured copying blocks back (None: none copied yet)


class KVTier:
    """Blocks below the paged cache. Blocks travel as one uint8 tensor: every layer's keys, then
    every layer's values, as the paged cache holds them."""

    def __init__(
        self,
        layout: KVLayout,
        slot_bytes: int,
        host_bytes: int,
        disk_dir: Path | None,
        disk_bytes: int,
        shared: bool = False,
    ):
        self.slot_bytes = slot_bytes
        self.block_size = layout.block_size
        self.host_blocks = host_bytes // slot_bytes
        self.host: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.disk = DiskTier(disk_dir, layout, slot_bytes, disk_bytes) if disk_dir is not None and disk_bytes else None
        self.shared = (
            SharedTierFiles(disk_dir, self.disk.path, layout, slot_bytes) if shared and self.disk is not None else None
        )
        self.hits: Counter[str] = Counter()
        self.misses = 0
        self.evictions: Counter[str] = Counter()
        self.loaded_blocks, self.load_seconds = 0, 0.0
        self.events: KvEventLog | None = None

    def publish_to(self, events: KvEventLog) -> None:
        """From now on the host and disk levels' changes go to `events`, starting with what the
        disk already holds (a restarted worker's file)."""
        self.events = events
        if self.disk is not None:
            events.stored(DISK, list(self.disk.index))

    def put(self, digest: bytes, data: torch.Tensor) -> None:
        """Keeps an evicted block (host first; the host's least recently used go to disk)."""
        if self.host_blocks == 0:
            self._to_disk(digest, data)
            return
        fresh = digest not in self.host
        self.host[digest] = data
        self.host.move_to_end(digest)
        if fresh and self.events is not None:
            self.events.stored(HOST, [digest])
        while len(self.host) > self.host_blocks:
            old_digest, old = self.host.popitem(last=False)
            self.evictions["host"] += 1
            if self.events is not None:
                self.events.removed(HOST, [old_digest])
            self._to_disk(old_digest, old)

    def _to_disk(self, digest: bytes, data: torch.Tensor) -> None:
        if self.disk is None:
            return
        fresh = digest not in self.disk.index
        victim = next(iter(self.disk.index)) if fresh and not self.disk.free else None
        if self.disk.put(digest, data):
            self.evictions["disk"] += 1
        if self.events is not None:
            self.events.removed(DISK, [victim] if victim is not None else [])
            self.events.stored(DISK, [digest] if fresh else [])

    def get(self, digest: bytes) -> torch.Tensor | None:
        """The block's bytes, from the nearest level that holds it (a hit there), or None (a miss)."""
        data = self.host.get(digest)
        if data is not None:
            self.hits["host"] += 1
            return data
        data = self.disk.get(digest) if self.disk is not None else None
        if data is not None:
            self.hits["disk"] += 1
            return data
        data = self.shared.get(digest) if self.shared is not None else None
        if data is not None:
            self.hits["shared"] += 1
            return data
        self.misses += 1
        return None

    def counters(self) -> TierCounters:
        return TierCounters(
            hits={level: self.hits[level] for level in LEVELS},
            misses=self.misses,
            evictions={level: self.evictions[level] for level in LEVELS},
            blocks={
                "host": len(self.host),
                "disk": len(self.disk.index) if self.disk else 0,
                "shared": len(self.shared.index) if self.shared else 0,
            },
            capacity_tokens=(self.host_blocks + (self.disk.slots if self.disk else 0)) * self.block_size,
            load_tokens_per_s=self.loaded_blocks * self.block_size / self.load_seconds if self.load_seconds else None,
        )

    def reset_counters(self) -> None:
        self.hits.clear()
        self.evictions.clear()
        self.misses = 0
        self.loaded_blocks, self.load_seconds = 0, 0.0

    def close(self) -> None:
        """Writes the host level down to disk (least recently used first), then closes the files."""
        if self.shared is not None:
            self.shared.close()
        if self.disk is None:
            return
        for digest, data in self.host.items():
            self.disk.put(digest, data)
        self.disk.close()
        self.disk = None


class TierLink:
    """Connects a KVTier to one engine's paged cache (a list of per-layer (keys, values) tensors of
    [num_blocks, ...]): the block manager spills a block it evicts, and writes a block found in the
    tier into a free block."""

    def __init__(self, tier: KVTier, caches: list[tuple[torch.Tensor, torch.Tensor]]):
        self.tier, self.caches = tier, caches
        self.parts = [t[0].nbytes for pair in caches for t in pair]

    @staticmethod
    def slot_bytes(caches: list[tuple[torch.Tensor, torch.Tensor]]) -> int:
        return sum(t[0].nbytes for pair in caches for t in pair)

    def spill(self, digest: bytes, block: int) -> None:
        pieces = [t[block].reshape(-1).view(torch.uint8) for pair in self.caches for t in pair]
        self.tier.put(digest, torch.cat(pieces).cpu())

    def fetch(self, digest: bytes) -> torch.Tensor | None:
        """The tier's copy of a block (a hit), or None (a miss)."""
        started = time.perf_counter()
        data = self.tier.get(digest)
        self.tier.load_seconds += time.perf_counter() - started
        return data

    def write(self, block: int, data: torch.Tensor) -> None:
        """Copies a fetched block into paged block `block` (fetch and write time the tier's loads)."""
        started = time.perf_counter()
        offset = 0
        for tensor, size in zip((t for pair in self.caches for t in pair), self.parts, strict=True):
            tensor[block].view(-1).view(torch.uint8).copy_(data[offset : offset + size].to(tensor.device))
            offset += size
        self.tier.loaded_blocks += 1
        self.tier.load_seconds += time.perf_counter() - started


def _lock_a_file(directory: Path):
    """The first tier file of `directory` no other process holds, opened and locked."""
    for number in range(MAX_TIER_FILES):
        path = directory / f"tier-{number}.kv"
        handle = open(path, "a+b")  # noqa: SIM115 (held open for the tier's life)
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            continue
        return handle, path
    raise OSError(f"every KV tier file under {directory} is in use")


def _header(handle) -> str:
    handle.seek(0)
    return handle.read(HEADER_BYTES).split(b"\n", 1)[0].decode(errors="replace")


def open_tier(config: EngineConfig, layout: KVLayout, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> KVTier | None:
    """The tier `config` asks for, for an engine of `layout` with these paged caches (None: none;
    a tier needs prefix caching). Its disk files live under kv_tier_dir, else the cache directory's
    kv-tier, one directory per layout."""
    if not (config.kv_tier_host_bytes or config.kv_tier_disk_bytes) or not config.enable_prefix_caching:
        return None
    root = Path(config.kv_tier_dir) if config.kv_tier_dir else Path(config.cache_dir or default_cache_dir()) / "kv-tier"
    return KVTier(
        layout,
        TierLink.slot_bytes(caches),
        config.kv_tier_host_bytes,
        layout_directory(root, layout) if config.kv_tier_disk_bytes else None,
        config.kv_tier_disk_bytes,
        shared=config.kv_tier_shared,
    )


def layout_directory(root: Path, layout: KVLayout) -> Path:
    """Where tier files of `layout` live under `root`: one directory per layout."""
    digest = hashlib.blake2b(json.dumps(asdict(layout), sort_keys=True).encode(), digest_size=8).hexdigest()
    return root / digest
