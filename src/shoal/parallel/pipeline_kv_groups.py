"""How a pipeline's layers share KV blocks: all in one full-length group, windowed or not. A stage
that replaces a lost one replays every position of the live sequences from the boundary log, which
is indexed by that one table (a windowed group's table has no blocks below its reach)."""

from __future__ import annotations

from shoal.model.config import LlamaConfig
from shoal.model.kv_groups import KVGroups


def pipeline_kv_groups(config: LlamaConfig) -> KVGroups:
    return KVGroups.full(config.num_layers)
