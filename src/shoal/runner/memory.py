"""How many KV-cache blocks a memory budget buys."""

from __future__ import annotations

import torch


def free_memory_bytes(device: torch.device) -> int:
    """Free memory on the device: CUDA's free bytes, or MemAvailable for the CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo")


def num_kv_blocks(budget_bytes: int, block_size: int, bytes_per_token: int, max_useful_tokens: int) -> int:
    """Blocks that fit the budget, capped at what max_useful_tokens could ever use; at least 1."""
    affordable = budget_bytes // (block_size * bytes_per_token)
    useful = -(-max_useful_tokens // block_size)
    return max(1, min(affordable, useful))
