"""What a pipeline node can do, measured where it runs: its time per decoder layer on a reference
batch, and its free memory. The head measures itself; each `shoal stage` server measures itself
when probed; the partition planner weighs stages by these figures (NodeProfile, a wire message)."""

from __future__ import annotations

import socket
import statistics
import time

import torch

from shoal.config.engine import EngineConfig
from shoal.model.loader import Checkpoint, load_checkpoint
from shoal.parallel.pipeline_kv_groups import pipeline_kv_groups
from shoal.protocol.stage_frames import NodeProfile
from shoal.runner.devices import keeps_quantized, resolve_device, resolve_dtype
from shoal.runner.memory import free_memory_bytes
from shoal.runner.model_runner import ModelRunner, build_model
from shoal.runner.step_batch import StepBatch

# The reference batch: one prompt chunk and several decoding sequences, as a busy step has.
PROMPT_TOKENS = 64
DECODING_SEQUENCES = 8
TIMED_RUNS = 5


def reference_batch(block_size: int) -> StepBatch:
    """PROMPT_TOKENS of a prompt, and DECODING_SEQUENCES sequences decoding one token each after
    PROMPT_TOKENS - 1 cached ones; each sequence has its own blocks."""
    blocks_each = -(-PROMPT_TOKENS // block_size)
    tables = [list(range(i * blocks_each, (i + 1) * blocks_each)) for i in range(1 + DECODING_SEQUENCES)]
    last = PROMPT_TOKENS - 1
    return StepBatch(
        input_ids=[1] * (PROMPT_TOKENS + DECODING_SEQUENCES),
        positions=list(range(PROMPT_TOKENS)) + [last] * DECODING_SEQUENCES,
        query_lens=[PROMPT_TOKENS] + [1] * DECODING_SEQUENCES,
        start_positions=[0] + [last] * DECODING_SEQUENCES,
        block_tables=[tables],
        last_rows=[],
    )


def measure_node(config: EngineConfig, checkpoint: Checkpoint | None = None) -> NodeProfile:
    """Loads the model's first layer (with the embedding, whose lookup costs next to nothing) as the
    engine config would run it here, and times it on the reference batch."""
    device = resolve_device(config)
    dtype = resolve_dtype(config, device)
    free = free_memory_bytes(device)
    checkpoint = checkpoint or load_checkpoint(config.model, dtype, config.cache_dir, keeps_quantized(config, device))
    groups = pipeline_kv_groups(checkpoint.config)
    model = build_model(config, checkpoint, device, dtype, layers=range(1), kv_groups=groups)
    batch = reference_batch(config.block_size)
    runner = ModelRunner(model, sum(len(table) for table in batch.block_tables[0]), config.block_size)
    inputs = torch.tensor(batch.input_ids, device=device)
    times = []
    for run in range(TIMED_RUNS + 1):  # the first run warms caches and kernels up
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        runner.run_layers(batch, inputs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if run:
            times.append(time.perf_counter() - started)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{torch.get_num_threads()} CPU threads"
    return NodeProfile(statistics.median(times), free, socket.gethostname(), f"{device} ({name})")
