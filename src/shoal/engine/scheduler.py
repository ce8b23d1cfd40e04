"""Iteration-level scheduler: which tokens of which sequences the next forward step computes."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shoal.engine.block_manager import BlockManager
from shoal.engine.sequence import Sequence, SequenceStatus
from shoal.runner.step_batch import StepBatch


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute tokens [start, start + length) of `seq` this step."""

    seq: Sequence
    start: int
    length: int

    @property
    def completes_sequence(self) -> bool:
        """True when the chunk reaches the last known token, so a new token is sampled after it."""
        return self.start + self.length == self.seq.num_tokens


def batch_of(chunks: list[ScheduledChunk], groups: int) -> StepBatch:
    """The step batch that computes `chunks` (logits wanted for those completing their sequence),
    with the block tables of each of the `groups` KV groups."""
    input_ids: list[int] = []
    positions: list[int] = []
    last_rows: list[int] = []
    for chunk in chunks:
        input_ids.extend(chunk.seq.all_token_ids[chunk.start : chunk.start + chunk.length])
        positions.extend(range(chunk.start, chunk.start + chunk.length))
        if chunk.completes_sequence:
            last_rows.append(len(input_ids) - 1)
    return StepBatch(
        input_ids,
        positions,
        [c.length for c in chunks],
        [c.start for c in chunks],
        [[list(c.seq.block_tables[group]) for c in chunks] for group in range(groups)],
        last_rows,
    )


class Scheduler:
    """Running sequences first (decode or the rest of a chunked prefill), then waiting ones, under a
    per-step token budget. When blocks run out the newest running sequence is preempted by
    recompute: its blocks are freed (full ones stay in the prefix cache) and it re-enters the
    front of the waiting queue with all its tokens, output included, to prefill again. A sequence
    alone whose prefill chunk does not fit the free blocks (a windowed KV group holds a chunk's
    whole span) computes the part that does.

    Invariants: every sequence is in exactly one of `waiting` and `running`; WAITING sequences hold
    no blocks; at most `max_num_seqs` sequences run.
    """

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Sequences finished because they no longer fit the whole KV cache; the engine reports them.
        self.outgrown: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence, front: bool = False) -> None:
        """Queues a sequence; `front` puts it ahead of everything waiting (health probes)."""
        if front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, request_id: str) -> Sequence | None:
        for seq in list(self.waiting) + self.running:
            if seq.request_id == request_id:
                self.finish(seq, "abort")
                return seq
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def schedule(
        self, seq_limit: int | None = None, busy: frozenset[str] = frozenset(), max_chunks: int | None = None
    ) -> list[ScheduledChunk]:
        """Plans one step. `seq_limit` (from the adaptive batch controller) caps admissions; `busy`
        sequences (in a micro-batch still in flight) are neither scheduled nor preempted;
        `max_chunks` caps the sequences in this step (a pipeline's micro-batch)."""
        limit = min(self.max_num_seqs, seq_limit or self.max_num_seqs)
        budget = self.max_num_batched_tokens
        room = max_chunks or self.max_num_seqs
        chunks: list[ScheduledChunk] = []
        index = 0
        while index < len(self.running) and budget > 0 and len(chunks) < room:
            seq = self.running[index]
            if seq.request_id in busy:
                index += 1
                continue
            length = min(seq.num_uncomputed_tokens, budget)
            if len(self.running) == 1:  # no one to preempt: a prefill chunk shrinks to what fits
                length = self.block_manager.tokens_appendable(seq, length) or length
            while not self.block_manager.append_slots(seq, length):
                victim = next(s for s in reversed(self.running) if s.request_id not in busy)  # seq at the latest
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, length))
                budget -= length
                index += 1
        while self.waiting and budget > 0 and len(self.running) < limit and len(chunks) < room:
            seq = self.waiting[0]
            cached = self.block_manager.allocate_cached_prefix(seq)
            seq.num_computed_tokens = cached
            if not seq.num_preemptions:
                seq.num_cached_tokens = cached
            length = min(seq.num_uncomputed_tokens, budget)
            if not self.running:  # alone: a prefill chunk shrinks to what fits
                length = self.block_manager.tokens_appendable(seq, length) or length
            if not self.block_manager.append_slots(seq, length):
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                if self.running or not self._outgrew_the_cache(seq):
                    break
                # Alone with the whole cache and still too long: it has used all the room there is.
                self.finish(seq, "length")
                self.outgrown.append(seq)
                continue
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            chunks.append(ScheduledChunk(seq, seq.num_computed_tokens, length))
            budget -= length
        return chunks

    def _outgrew_the_cache(self, seq: Sequence) -> bool:
        manager = self.block_manager
        return manager.groups.blocks_held(seq.num_tokens, manager.block_size) > manager.num_usable_blocks

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
