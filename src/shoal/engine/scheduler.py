"""Iteration-level scheduler: which tokens of which sequences the next forward step computes."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

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
        """True when the chunk reaches the last known token (and the drafts after it), so a new
        token is sampled after it (one after each of them)."""
        return self.start + self.length == self.seq.num_tokens + len(self.seq.draft_token_ids)


def batch_of(chunks: list[ScheduledChunk], groups: int) -> StepBatch:
    """The step batch that computes `chunks` (logits wanted for those completing their sequence:
    for the last token and each draft after it), with the block tables of each of the `groups` KV
    groups."""
    input_ids: list[int] = []
    positions: list[int] = []
    last_rows: list[int] = []
    for chunk in chunks:
        tokens = chunk.seq.all_token_ids + chunk.seq.draft_token_ids
        input_ids.extend(tokens[chunk.start : chunk.start + chunk.length])
        positions.extend(range(chunk.start, chunk.start + chunk.length))
        if chunk.completes_sequence:
            scored = 1 + len(chunk.seq.draft_token_ids)
            last_rows.extend(range(len(input_ids) - scored, len(input_ids)))
    return StepBatch(
        input_ids,
        positions,
        [c.length for c in chunks],
        [c.start for c in chunks],
        [[list(c.seq.block_tables[group]) for c in chunks] for group in range(groups)],
        last_rows,
        tuple(c.seq.lora for c in chunks) if any(c.seq.lora for c in chunks) else (),
    )


@dataclass
class _Step:
    """One step being planned: its sequence limit, token budget left, room for chunks, the most
    LoRA adapters it may run, and chunks (with the adapters they run)."""

    limit: int
    budget: int
    room: int
    max_adapters: int
    chunks: list[ScheduledChunk] = field(default_factory=list)
    adapters: set[str] = field(default_factory=set)

    def takes(self, seq: Sequence) -> bool:
        """Whether the sequence's adapter (if any) fits the step's adapters."""
        return seq.lora is None or seq.lora in self.adapters or len(self.adapters) < self.max_adapters

    @property
    def open(self) -> bool:
        return self.budget > 0 and len(self.chunks) < self.room

    def add(self, chunk: ScheduledChunk) -> None:
        self.chunks.append(chunk)
        self.budget -= chunk.length
        if chunk.seq.lora is not None:
            self.adapters.add(chunk.seq.lora)


class Scheduler:
    """Running sequences first (decode or the rest of a chunked prefill), then waiting ones, under a
    per-step token budget. Waiting sequences queue by scheduling class (sequence.SCHEDULING_CLASSES),
    then arrival; while a sequence of another class waits or prefills, running background ones sit
    the step out (they keep their blocks, unless a foreground one needs them or their place), so
    interactive prefills run in short steps of their own.
    When blocks run out the newest running sequence is preempted by recompute: its blocks are freed
    (full ones stay in the prefix cache) and it re-enters the front of its class in the waiting
    queue with all its tokens, output included, to prefill again. A sequence
    alone whose prefill chunk does not fit the free blocks (a windowed KV group holds a chunk's
    whole span) computes the part that does.

    A step runs at most `max_loras` LoRA adapters: a sequence of another adapter sits it out.

    Invariants: every sequence is in exactly one of `waiting` and `running`; WAITING sequences hold
    no blocks; at most `max_num_seqs` sequences run; `waiting` is in class order. Preemption takes
    the newest background sequence first.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        background_step_tokens: int | None = None,
        max_loras: int = 1,
    ):
        """`background_step_tokens`: the most tokens background sequences compute in one step
        (default: the whole step budget); `max_loras`: the most LoRA adapters in one step."""
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.background_step_tokens = background_step_tokens or max_num_batched_tokens
        self.max_loras = max_loras
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        # Sequences finished because they no longer fit the whole KV cache; the engine reports them.
        self.outgrown: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queues a sequence behind those of its class and ahead of later classes."""
        self._queue(seq, behind_its_class=True)

    def _queue(self, seq: Sequence, behind_its_class: bool) -> None:
        rank = seq.scheduling_rank
        position = next(
            (
                i
                for i, other in enumerate(self.waiting)
                if other.scheduling_rank > rank or (not behind_its_class and other.scheduling_rank == rank)
            ),
            len(self.waiting),
        )
        self.waiting.insert(position, seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def outstanding_tokens(self) -> tuple[int, int]:
        """(prompt tokens not yet in the KV cache, tokens still to generate at most) of the running and
        waiting sequences: the work ahead a load report tells routers."""
        live = [*self.running, *self.waiting]
        prefill = sum(max(0, len(s.prompt_token_ids) - s.num_computed_tokens) for s in live)
        return prefill, sum(s.params.max_tokens - len(s.output_token_ids) for s in live)

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
        `max_chunks` caps the sequences in this step (a pipeline's micro-batch). Foreground
        sequences (every class but background) are planned first, and may preempt background ones
        for blocks or a place; background ones are planned only when no foreground sequence
        prefills in this step or is left waiting."""
        step = _Step(
            min(self.max_num_seqs, seq_limit or self.max_num_seqs),
            self.max_num_batched_tokens,
            max_chunks or self.max_num_seqs,
            self.max_loras,
        )
        self._continue_running(step, busy, background=False)
        self._admit_waiting(step, busy, background=False)
        # A chunk longer than its token and drafts is a prefill; `waiting` is in class order.
        foreground_prefills = any(c.length > 1 + len(c.seq.draft_token_ids) for c in step.chunks) or bool(
            self.waiting and self.waiting[0].scheduling != "background"
        )
        if not foreground_prefills:
            step.budget = min(step.budget, self.background_step_tokens)
            self._continue_running(step, busy, background=True)
            self._admit_waiting(step, busy, background=True)
        return step.chunks

    def _continue_running(self, step: _Step, busy: frozenset[str], background: bool) -> None:
        """Decodes and prefill chunks of running sequences of the class, in order; when blocks run
        out the newest (background first) is preempted."""
        index = 0
        while index < len(self.running) and step.open:
            seq = self.running[index]
            if seq.request_id in busy or (seq.scheduling == "background") != background or not step.takes(seq):
                index += 1
                continue
            length = min(seq.num_uncomputed_tokens + len(seq.draft_token_ids), step.budget)
            if len(self.running) == 1:  # no one to preempt: a prefill chunk shrinks to what fits
                length = self.block_manager.tokens_appendable(seq, length) or length
            del seq.draft_token_ids[max(0, length - seq.num_uncomputed_tokens) :]  # the drafts that fit
            while not self.block_manager.append_slots(seq, length):
                victim = self._victim(busy)  # seq at the latest
                self._preempt(victim)
                if victim is seq:
                    break
            else:
                step.add(ScheduledChunk(seq, seq.num_computed_tokens, length))
                index += 1

    def _admit_waiting(self, step: _Step, busy: frozenset[str], background: bool) -> None:
        """Starts waiting sequences of the class, in queue order; a foreground one preempts running
        background sequences (newest first) when it needs their place or blocks."""
        while self.waiting and step.open and (self.waiting[0].scheduling == "background") == background:
            seq = self.waiting[0]
            if not step.takes(seq):
                return
            if len(self.running) >= step.limit:
                if background or not self._preempt_background(busy):
                    return
                continue
            cached = self.block_manager.allocate_cached_prefix(seq)
            seq.num_computed_tokens = cached
            if not seq.num_preemptions:
                seq.num_cached_tokens = cached
            length = min(seq.num_uncomputed_tokens, step.budget)
            if not self.running:  # alone: a prefill chunk shrinks to what fits
                length = self.block_manager.tokens_appendable(seq, length) or length
            if not self.block_manager.append_slots(seq, length):
                self.block_manager.free(seq)
                seq.num_computed_tokens = 0
                if not background and self._preempt_background(busy):
                    continue
                if self.running or not self._outgrew_the_cache(seq):
                    return
                # Alone with the whole cache and still too long: it has used all the room there is.
                self.finish(seq, "length")
                self.outgrown.append(seq)
                continue
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            step.add(ScheduledChunk(seq, seq.num_computed_tokens, length))

    def _preempt_background(self, busy: frozenset[str]) -> bool:
        """Preempts the newest running background sequence not in flight; False when there is none."""
        victim = next(
            (s for s in reversed(self.running) if s.scheduling == "background" and s.request_id not in busy), None
        )
        if victim is not None:
            self._preempt(victim)
        return victim is not None

    def _victim(self, busy: frozenset[str]) -> Sequence:
        """The newest running background sequence not in flight, else the newest one not in flight."""
        candidates = [s for s in reversed(self.running) if s.request_id not in busy]
        return next((s for s in candidates if s.scheduling == "background"), candidates[0])

    def _outgrew_the_cache(self, seq: Sequence) -> bool:
        manager = self.block_manager
        return manager.groups.blocks_held(seq.num_tokens, manager.block_size) > manager.num_usable_blocks

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.draft_token_ids.clear()
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self._queue(seq, behind_its_class=False)
