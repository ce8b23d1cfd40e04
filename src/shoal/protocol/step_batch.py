"""The wire schema of one forward step's batch (engine StepBatch), as sent to pipeline stages and
tensor-parallel ranks, with the checks a receiver makes before the batch reaches a kernel."""

from __future__ import annotations

from typing import Annotated

import msgspec

from shoal.protocol.frames import BadFrame

Count = Annotated[int, msgspec.Meta(ge=0)]


class StepBatchFrame(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Sequence i computes query_lens[i] tokens from start_positions[i] with block_tables[g][i] in
    KV group g;
    positions lists every token's position; input_ids are the tokens (empty when hidden states
    travel instead); last_rows are the rows whose logits are wanted; lora_names, when not empty,
    the LoRA adapter each sequence runs (None: the base model)."""

    input_ids: list[Count]
    positions: list[Count]
    query_lens: list[Annotated[int, msgspec.Meta(ge=1)]]
    start_positions: list[Count]
    block_tables: list[list[list[Count]]]
    last_rows: list[Count]
    lora_names: tuple[str | None, ...] = ()

    def check(self, num_blocks: int, block_size: int, groups: int) -> None:
        """Raises BadFrame unless the lists agree with each other and every slot the batch touches
        lies in a block of the receiver's cache (`num_blocks` blocks of `block_size` slots, in each
        of its `groups` KV groups)."""
        sequences = len(self.query_lens)
        if len(self.block_tables) != groups:
            raise BadFrame(f"batch of block tables for {len(self.block_tables)} KV groups, not {groups}")
        if len(self.start_positions) != sequences or any(len(tables) != sequences for tables in self.block_tables):
            raise BadFrame(
                f"batch of {sequences} sequences has {len(self.start_positions)} start positions "
                f"and {[len(tables) for tables in self.block_tables]} block tables"
            )
        rows = len(self.positions)
        if sum(self.query_lens) != rows or len(self.input_ids) not in (0, rows):
            raise BadFrame(
                f"batch of {sum(self.query_lens)} query tokens has {rows} positions and {len(self.input_ids)} input ids"
            )
        if self.lora_names and len(self.lora_names) != sequences:
            raise BadFrame(f"batch of {sequences} sequences names {len(self.lora_names)} LoRA adapters")
        if any(row >= rows for row in self.last_rows):
            raise BadFrame(f"a last row is out of the batch's {rows} rows")
        row = 0
        for index, (start, length) in enumerate(zip(self.start_positions, self.query_lens)):
            if self.positions[row : row + length] != list(range(start, start + length)):
                raise BadFrame("a sequence's positions do not run from its start position")
            for tables in self.block_tables:
                table = tables[index]
                if -(-(start + length) // block_size) > len(table) or any(block >= num_blocks for block in table):
                    raise BadFrame(f"a block table does not cover its positions in {num_blocks} blocks")
            row += length
