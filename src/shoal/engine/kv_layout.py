"""What must match for KV blocks to move between engines: same model (its shapes and a fingerprint
of its weights), dtype, block size, KV slots and groups (shoal.model.kv_groups), KV heads and head
size. `KVLayout.check_compatible`
refuses the rest, naming what differs."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass

import torch


class KVLayoutMismatch(ValueError):
    """The blocks' layout differs from the receiving engine's (the message names the fields)."""


@dataclass(frozen=True)
class KVLayout:
    """What must match for KV blocks to be reusable by another engine."""

    model: str  # fingerprint of the model's config and weights (model_fingerprint)
    dtype: str
    block_size: int
    kv_slots: int  # layers a block holds
    kv_groups: int
    num_kv_heads: int
    head_dim: int

    def check_compatible(self, other: KVLayout) -> None:
        differing = [
            f"{field.name} {getattr(other, field.name)!r} (here {getattr(self, field.name)!r})"
            for field in dataclasses.fields(self)
            if getattr(self, field.name) != getattr(other, field.name)
        ]
        if differing:
            raise KVLayoutMismatch("KV blocks of another layout: " + ", ".join(differing))


def model_fingerprint(config: object, model: torch.nn.Module) -> str:
    """The model's shapes (its config) and a sample of its weights (the final norm): two checkpoints
    with the same architecture and other weights differ here."""
    digest = hashlib.blake2b(digest_size=12)
    digest.update(json.dumps(dataclasses.asdict(config), sort_keys=True, default=str).encode())
    digest.update(model.norm.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()
