"""One request's state inside the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from shoal.engine.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


# Scheduling classes, first to last: health probes go ahead of everything waiting; background work
# (a router's batches) waits behind the others and pauses while an interactive request prefills.
SCHEDULING_CLASSES = ("probe", "interactive", "background")


@dataclass
class Sequence:
    """Prompt + generated tokens, and how much of them is in the KV cache.

    Invariants: 0 <= num_computed_tokens <= num_tokens; while RUNNING there is a block table per KV
    group (shoal.model.kv_groups), each covering at least num_computed_tokens slots; while WAITING
    there is none; `seed` is always set (drawn by
    the engine when the request gave none), so every sampled token is reproducible.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    scheduling: str = "interactive"  # one of SCHEDULING_CLASSES
    arrival_time: float = field(default_factory=time.monotonic)
    # Monotonic times of this engine's first scheduling, and first and latest sampled token.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    # Where the step that produced the first token spent its time: (pipeline stage, start, end),
    # in nanoseconds since the epoch; empty unless the model runs as a pipeline.
    first_token_stage_times: list[tuple[int, int, int]] = field(default_factory=list)
    output_token_ids: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_tables: list[list[int]] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # Tokens proposed for the next step (speculative decoding): scored with the last token, kept
    # as far as they equal the tokens the sequence samples itself; never part of all_token_ids.
    draft_token_ids: list[int] = field(default_factory=list)
    # How many tokens to draft next (None: the engine's most), and steps left without drafting:
    # set from how many drafts were kept (engine.speculation.Speculation).
    draft_limit: int | None = None
    draft_pause: int = 0
    # Drafts kept and refused so far (a predicted output's accepted and rejected tokens).
    kept_drafts: int = 0
    refused_drafts: int = 0
    # The LoRA adapter it runs (None: the base model), and what sets its KV apart in the prefix
    # cache (the adapter's digest; None for the base model).
    lora: str | None = None
    cache_salt: bytes | None = None

    @property
    def scheduling_rank(self) -> int:
        return SCHEDULING_CLASSES.index(self.scheduling)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
