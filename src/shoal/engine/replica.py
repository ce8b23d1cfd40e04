"""A replica's model, KV cache and runner, built for its layout: one process, tensor-parallel ranks
(a TensorParallelGroup of follower processes) or a pipeline (stages measured and planned first).

Invariant: the block manager has exactly as many blocks as the runner's caches, which hold the KV
budget (`kv_cache_bytes`, else `kv_cache_fraction` of free memory) or, in a pipeline, what every
stage's own budget allows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shoal.config.engine import EngineConfig
from shoal.engine.block_manager import BlockManager
from shoal.model.loader import Checkpoint
from shoal.model.lora_adapter import adapter_memory_bytes
from shoal.model.lora_registry import LoraRegistry
from shoal.model.sharding import check_shardable
from shoal.runner.memory import free_memory_bytes, num_kv_blocks
from shoal.runner.model_runner import ModelRunner, build_model, lora_registry

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Replica:
    model: torch.nn.Module
    block_manager: BlockManager
    runner: object  # ModelRunner, TensorParallelRunner or PipelineRunner: run, submit, collect, depth
    tensor_group: object | None  # the TensorParallelGroup of a tensor-parallel replica
    kv_cache_budget_bytes: int
    loras: LoraRegistry | None  # the LoRA adapters it serves (None: LoRA is off)


def kv_budget(config: EngineConfig, model_config, free_bytes: int) -> int:
    """The KV cache's bytes: `kv_cache_bytes`, else `kv_cache_fraction` of the memory the held LoRA
    adapters leave free. MemoryError naming them where the adapters and the KV cache cannot fit."""
    adapters = config.held_loras * adapter_memory_bytes(model_config, config.max_lora_rank) if config.enable_lora else 0
    budget = config.kv_cache_bytes or int(max(0, free_bytes - adapters) * config.kv_cache_fraction)
    if adapters + budget > free_bytes:
        raise MemoryError(
            f"{config.held_loras} LoRA adapters of rank up to {config.max_lora_rank} take up to "
            f"{adapters / 2**30:.2f} GiB held, and with {budget / 2**30:.2f} GiB of KV cache that is more than "
            f"the {free_bytes / 2**30:.2f} GiB free: lower max_cpu_loras, max_lora_rank or the KV cache"
        )
    return budget


def build_replica(
    config: EngineConfig,
    checkpoint: Checkpoint,
    device: torch.device,
    dtype: torch.dtype,
    max_model_len: int,
    live_sequences: Callable[[], list[tuple[list[int], int]]],
    on_replica_failure: Callable[[str], None] | None,
) -> Replica:
    """`live_sequences` gives a pipeline the sequences to replay when it replaces a stage;
    `on_replica_failure` is called (from another thread) when a process of the replica dies."""
    if config.tensor_parallel_size > 1 and config.pipeline_parallel_size > 1:
        raise ValueError("tensor and pipeline parallelism in one replica are not supported together yet")
    if config.enable_lora and config.pipeline_parallel_size > 1:
        raise ValueError("LoRA adapters run in one process or under tensor parallelism, not in a pipeline")
    tensor_group = None
    if config.tensor_parallel_size > 1:
        from shoal.parallel.tensor_group import TensorParallelGroup

        check_shardable(checkpoint.config, config.tensor_parallel_size)
        tensor_group = TensorParallelGroup(config, on_replica_failure)
    layout = None
    if config.pipeline_parallel_size > 1:
        from shoal.parallel.pipeline_kv_groups import pipeline_kv_groups
        from shoal.parallel.pipeline_plan import PipelineLayout

        layout = PipelineLayout.measure(config, checkpoint, dtype, max_model_len)
        log.info("pipeline plan:\n%s", layout.describe())
    model = build_model(
        config,
        checkpoint,
        device,
        dtype,
        layers=layout.head_layers if layout else None,
        tensor_parallel=tensor_group.context if tensor_group else None,
        kv_groups=pipeline_kv_groups(checkpoint.config) if layout else None,
    )
    budget = kv_budget(config, model.config, free_memory_bytes(device))
    if layout:
        blocks = layout.num_blocks
    else:
        # What the longest sequences could hold at once, and the NULL_BLOCK of windowed groups.
        longest = model.kv_groups.blocks_held(max_model_len, config.block_size)
        most_blocks = config.max_num_seqs * longest + model.kv_groups.windowed
        blocks = num_kv_blocks(
            budget, config.block_size, model.kv_bytes_per_block_token(), most_blocks * config.block_size
        )
    block_manager = BlockManager(blocks, config.block_size, config.enable_prefix_caching, model.kv_groups)
    loras = lora_registry(config, checkpoint, dtype, device, tensor_group.context if tensor_group else None)
    if tensor_group:
        from shoal.parallel.tensor_group import TensorParallelRunner

        runner = TensorParallelRunner(tensor_group, model, blocks, config.block_size, loras)
    elif layout:
        from shoal.parallel.pipeline import PipelineRunner, PipelineSettings

        runner = PipelineRunner(
            config,
            model,
            layout,
            live_sequences,
            block_manager.forget_free_cached,
            PipelineSettings(
                wire_dtype=config.pipeline_wire_dtype,
                spare_addresses=tuple(config.spare_stage_servers),
                local_spares=config.spare_stages,
                step_deadline_s=config.pipeline_step_deadline_s,
                ping_timeout_s=config.pipeline_ping_timeout_s,
            ),
        )
    else:
        runner = ModelRunner(model, blocks, config.block_size, loras)
    return Replica(model, block_manager, runner, tensor_group, budget, loras)
