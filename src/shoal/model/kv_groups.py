"""Layers grouped by attention kind for the paged KV cache (full attention, or a sliding window W).

Each group has a block table of its own per sequence, and one pool of blocks serves every group: a
block holds the keys and values of `slots` layers, and layer `layers[g][j]` keeps its KV in slot j
of the blocks of group g's table. So a windowed group can give back the blocks that slid out of
every query's reach while a full-attention group keeps them all (vLLM's hybrid KV cache manager
idea), without splitting the memory between kinds in advance.

A model without windows has one group of all its layers; one whose layers all have the same window
has one windowed group. Groups of a kind hold `slots` layers each (the last may hold fewer): `slots`
is the size of the smallest kind, raised so there are at most MAX_GROUPS groups.
"""

from __future__ import annotations

from dataclasses import dataclass

from shoal.model.config import LlamaConfig

MAX_GROUPS = 8
# The block every windowed group's table points at below its reach, and that no sequence owns: reads
# of it are masked or skipped, writes to it (a replay of early positions) are never read.
NULL_BLOCK = 0


@dataclass(frozen=True)
class KVGroups:
    """Invariants: every layer is in exactly one group; a group holds 1..slots layers, all with the
    window windows[g] (0: full attention); full-attention groups come first."""

    windows: tuple[int, ...]
    layers: tuple[tuple[int, ...], ...]
    slots: int

    @classmethod
    def of(cls, config: LlamaConfig) -> KVGroups:
        kinds: dict[int, list[int]] = {}
        for layer in range(config.num_layers):
            kinds.setdefault(config.window(layer), []).append(layer)
        ordered = sorted(kinds.items())  # window 0 (full attention) first
        slots = max(min(len(layers) for _, layers in ordered), -(-config.num_layers // MAX_GROUPS))
        windows, groups = [], []
        for window, layers in ordered:
            for start in range(0, len(layers), slots):
                windows.append(window)
                groups.append(tuple(layers[start : start + slots]))
        return cls(tuple(windows), tuple(groups), slots)

    @classmethod
    def full(cls, num_layers: int) -> KVGroups:
        """One full-attention group of `num_layers` layers (a cache that frees nothing early)."""
        return cls((0,), (tuple(range(num_layers)),), num_layers)

    @property
    def count(self) -> int:
        return len(self.windows)

    @property
    def windowed(self) -> bool:
        """Whether some group frees blocks early (and block NULL_BLOCK is kept out of the pool)."""
        return any(self.windows)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot) of a layer."""
        for group, layers in enumerate(self.layers):
            if layer in layers:
                return group, layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV group")

    def first_needed_block(self, group: int, position: int, block_size: int) -> int:
        """The first block of group `group` that a query at `position` (or any later one) may read."""
        window = self.windows[group]
        return max(0, position - window + 1) // block_size if window else 0

    def blocks_held(self, num_tokens: int, block_size: int) -> int:
        """Blocks a sequence holds over all groups in the step that computes its token `num_tokens - 1`
        (one token a step: its decode)."""
        table = -(-num_tokens // block_size)
        last = max(0, num_tokens - 1)
        return sum(table - self.first_needed_block(g, last, block_size) for g in range(self.count))

    def tokens_fitting(self, num_blocks: int, block_size: int, most: int) -> int:
        """The longest sequence (at most `most` tokens) whose decode fits in `num_blocks` blocks."""
        low, high = 0, most
        while low < high:
            middle = (low + high + 1) // 2
            if self.blocks_held(middle, block_size) <= num_blocks:
                low = middle
            else:
                high = middle - 1
        return low
