"""Runs one step batch through the model and returns the logits to sample from."""

from __future__ import annotations

import dataclasses
import functools

import torch

from shoal.config.engine import EngineConfig
from shoal.model.config import LlamaConfig
from shoal.model.invariant_linear import default_tile_rows
from shoal.model.kv_groups import KVGroups
from shoal.model.llama import LlamaModel
from shoal.model.loader import Checkpoint
from shoal.model.lora_batch import LoraBatch
from shoal.model.lora_registry import LoraRegistry
from shoal.model.paged_attention import AttentionMetadata, build_attention_metadata
from shoal.model.quantized_weight import QuantizedWeight
from shoal.model.sharding import TensorParallel, shard_adapter
from shoal.runner.step_batch import StepBatch


def served_model_config(config: EngineConfig, model_config: LlamaConfig) -> LlamaConfig:
    """The model's config for the context this engine serves: RoPE scaled for max_model_len (longrope
    takes its long factors past its original context, else its short ones), so every rank and stage
    rotates alike, and the KV fingerprint says which."""
    positions = config.max_model_len or model_config.max_position_embeddings
    scaling = model_config.rope_scaling.for_context(positions, model_config.max_position_embeddings)
    return dataclasses.replace(model_config, rope_scaling=scaling)


def build_model(
    config: EngineConfig,
    checkpoint: Checkpoint,
    device: torch.device,
    dtype: torch.dtype,
    layers: range | None = None,
    tensor_parallel: TensorParallel | None = None,
    kv_groups: KVGroups | None = None,
) -> LlamaModel:
    """The model (or the layers of one pipeline stage, or one tensor-parallel rank's shard) as the
    engine config asks: batch-invariant tiles, prepacked weights, attention kernel. Quantized
    weights in the checkpoint (loaded so by `keeps_quantized`) stay quantized. `kv_groups`: how its
    layers share KV blocks (default: grouped by attention kind, shoal.model.kv_groups)."""
    tile_rows = default_tile_rows(dtype) if config.batch_invariant else 0
    weights = {k: v if isinstance(v, QuantizedWeight) else v.to(dtype) for k, v in checkpoint.weights.items()}
    return LlamaModel(
        served_model_config(config, checkpoint.config),
        weights,
        tile_rows,
        device,
        config.packs_weights,
        config.attention_kernel,
        layers=layers,
        tensor_parallel=tensor_parallel,
        kv_groups=kv_groups,
    )


def lora_registry(
    config: EngineConfig,
    checkpoint: Checkpoint,
    dtype: torch.dtype,
    device: torch.device,
    tensor_parallel: TensorParallel | None = None,
) -> LoraRegistry | None:
    """The LoRA adapters a model built by build_model serves (None where LoRA is off): checked
    against the whole model, each held as this rank's part under tensor parallelism."""
    if not config.enable_lora:
        return None
    model_config = served_model_config(config, checkpoint.config)
    return LoraRegistry(
        model_config,
        config.max_lora_rank,
        config.held_loras,
        dtype,
        device,
        default_tile_rows(dtype) if config.batch_invariant else 0,
        config.packs_weights,
        functools.partial(shard_adapter, config=model_config, tp=tensor_parallel) if tensor_parallel else None,
    )


class ModelRunner:
    """Owns the model and its KV cache. Invariant: the cache has `num_blocks` blocks of `block_size`
    token slots in each KV slot the model's layers use, matching the BlockManager that hands them out."""

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, loras: LoraRegistry | None = None):
        """`loras`: the adapters a step's sequences may name (None: LoRA is off)."""
        self.model = model
        self.loras = loras
        self.block_size = block_size
        self.num_blocks = num_blocks
        # Row tiles of attention hold whole query-head groups; their height is fixed per model.
        group = model.config.num_queries_per_kv
        self.attention_tile_height = max(8, -(-group // 8) * 8)
        self.kv_caches = model.allocate_kv_cache(num_blocks, block_size)

    # How many micro-batches this runner keeps in flight (a pipeline: one per stage).
    depth = 1

    def submit(self, batch: StepBatch) -> object:
        """Starts a micro-batch; collect(handle) gives its logits. Here nothing runs until then."""
        return batch

    def collect(self, handle: object) -> torch.Tensor:
        return self.run(handle)

    def stage_times(self, handle: object) -> list[tuple[int, int, int]]:
        """For a collected micro-batch: (pipeline stage, start, end) of each stage's compute, in
        nanoseconds since the epoch; empty for a model in one process."""
        return []

    def run(self, batch: StepBatch) -> torch.Tensor:
        """The whole model on one batch in one forward pass: float32 logits [len(last_rows), vocab]
        on the CPU, for the rows whose sequences sample next, in order."""
        hidden = self.run_layers(batch, torch.tensor(batch.input_ids, device=self.model.device))
        return self.logits(batch, hidden)

    def run_layers(self, batch: StepBatch, inputs: torch.Tensor) -> torch.Tensor:
        """The layers held on `inputs` (token ids, or hidden states from earlier layers)."""
        device = self.model.device
        return self.model.forward(
            inputs,
            torch.tensor(batch.positions, device=device),
            self.kv_caches,
            self.metadata(batch),
            self._lora(batch),
        )

    def _lora(self, batch: StepBatch) -> LoraBatch | None:
        """The step's adapted rows: each sequence's tokens run its adapter."""
        if not batch.lora_names:
            return None
        if self.loras is None:
            raise ValueError("a step names LoRA adapters and this engine serves none")
        rows = []
        for name, length in zip(batch.lora_names, batch.query_lens):
            rows += [None if name is None else self.loras.adapter(name)] * length
        return LoraBatch.of_rows(rows, self.model.lora_widths, self.model.device)

    def logits(self, batch: StepBatch, hidden: torch.Tensor) -> torch.Tensor:
        if not batch.last_rows:
            return torch.empty(0, self.model.config.vocab_size)
        rows = hidden[torch.tensor(batch.last_rows, device=self.model.device)]
        return self.model.compute_logits(rows).cpu()

    def shutdown(self) -> None:
        """Stops the processes this runner drives (none for a single process)."""

    def interrupt(self) -> None:
        """Callable from any thread: a wait on other processes in progress raises ReplicaFailedError
        (a single process never waits on others)."""

    def metadata(self, batch: StepBatch) -> list[AttentionMetadata]:
        """The step's attention metadata of each KV group."""
        return build_attention_metadata(
            query_lens=batch.query_lens,
            start_positions=batch.start_positions,
            block_tables=batch.block_tables,
            block_size=self.block_size,
            num_kv_heads=self.model.config.num_kv_heads,
            queries_per_kv=self.model.config.num_queries_per_kv,
            tile_height=self.attention_tile_height,
            device=self.model.device,
            windows=self.model.kv_groups.windows,
            with_tiles=self.model.attention_uses_tiles,
        )
