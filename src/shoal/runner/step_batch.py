"""One forward step as plain lists: what a runner is given, locally or sent to other ranks and
pipeline stages (protocol.step_batch is its wire form)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepBatch:
    """One forward step as plain lists, so it can be sent to other ranks and pipeline stages.
    Sequence i computes query_lens[i] tokens from start_positions[i] with block_tables[g][i] in KV
    group g;
    last_rows are the rows (into input_ids) whose logits are wanted, in order; lora_names, when not
    empty, is the LoRA adapter each sequence runs (None: the base model)."""

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    start_positions: list[int]
    block_tables: list[list[list[int]]]
    last_rows: list[int]
    lora_names: tuple[str | None, ...] = ()
