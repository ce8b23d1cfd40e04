"""Drafts from a draft model: a second, cheaper model with the target's tokenizer (a smaller model of
the family, or the same weights quantized), run by the same engine ahead of each decoding sequence.

Each drafting sequence has a shadow here: a Sequence of the draft's own, with the same prompt and the
target's output, whose blocks in the draft's KV cache hold its first num_computed_tokens tokens. A
proposal catches the shadow up on the tokens the target added since (the whole prompt the first
time, in pieces of at most max_num_batched_tokens a step), then runs one forward pass per draft
token. The drafts' KV is written past num_computed_tokens, which advances over them only once the
target has kept them, so a refused draft's slots are simply written again (its blocks beyond are
given back), and only kept tokens' blocks ever enter the draft's prefix cache.

Drafts are drawn with the sequence's own sampling settings, seed and positions (sampler's uniform
for (seed, position)): where the draft model's distribution is close to the target's, a sampled
request drafts the very token the target will draw, not only the most likely one.
"""

from __future__ import annotations

import dataclasses
import logging

import torch

from shoal.config.engine import EngineConfig
from shoal.config.speculative import SpeculativeConfig
from shoal.engine.block_manager import BlockManager
from shoal.engine.output_stream import OutputStream
from shoal.engine.replica import build_replica
from shoal.engine.sampler import SamplingRow, sample
from shoal.engine.sequence import Sequence
from shoal.model.errors import ModelLoadError
from shoal.model.loader import load_checkpoint
from shoal.model.tokenizer import Tokenizer
from shoal.runner.devices import keeps_quantized
from shoal.runner.step_batch import StepBatch

log = logging.getLogger(__name__)

# The most tokens a shadow catches up on per token its sequence may still generate: a catch-up token
# costs the draft model a prompt token (a small fraction of a step), a token left saves at most a
# step; a sequence further behind than this (one that starts drafting near its end) does not draft.
CATCH_UP_PER_TOKEN_LEFT = 8


def draft_engine_config(config: EngineConfig, kv_cache_bytes: int) -> EngineConfig:
    """The draft model's config: the target's, for `speculative.model` in one process, its quantized
    matrices kept as they are (what makes a quantized self-draft cheap), with a KV budget of its own."""
    return dataclasses.replace(
        config,
        model=config.speculative.model,
        speculative=SpeculativeConfig(),
        keep_quantized=True,
        kv_cache_bytes=kv_cache_bytes,
        tensor_parallel_size=1,
        enable_expert_parallel=False,
        pipeline_parallel_size=1,
        layers_per_stage=None,
        stage_servers=(),
        spare_stage_servers=(),
        spare_stages=0,
        kv_tier_host_bytes=0,
        kv_tier_disk_bytes=0,
    )


class DraftModel:
    """Invariants: `shadows` holds one Sequence per sequence that drafted and is still live, each with
    a block table per KV group of `block_manager` covering its num_computed_tokens; a shadow's tokens
    are its sequence's known tokens (never drafts)."""

    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer,
        vocab_size: int,
        device: torch.device,
        dtype: torch.dtype,
        max_model_len: int,
        kv_cache_bytes: int,
    ):
        """Loads `config.speculative.model` to draft ids below `vocab_size` (the target's);
        ModelLoadError, naming it, when its tokenizer is not the target's (its drafts would be other
        tokens' ids) or its context is shorter than max_model_len."""
        draft_config = draft_engine_config(config, kv_cache_bytes)
        name = draft_config.model
        checkpoint = load_checkpoint(name, dtype, config.cache_dir, keeps_quantized(draft_config, device))
        if checkpoint.tokenizer.vocabulary() != tokenizer.vocabulary():
            raise ModelLoadError(
                f"the draft model {name} has another tokenizer than the target {config.model}: "
                f"a draft model must share the target's vocabulary"
            )
        if checkpoint.config.max_position_embeddings < max_model_len:
            raise ModelLoadError(
                f"the draft model {name} has {checkpoint.config.max_position_embeddings} positions; the "
                f"target runs up to {max_model_len}"
            )
        replica = build_replica(draft_config, checkpoint, device, dtype, max_model_len, list, None)
        self.vocab_size = vocab_size
        self.block_manager: BlockManager = replica.block_manager
        self.runner = replica.runner
        self.groups = self.block_manager.groups.count
        self.catch_up_tokens = config.max_num_batched_tokens
        self.shadows: dict[str, Sequence] = {}
        log.info("draft model %s: %d KV blocks", name, self.block_manager.num_blocks)

    def retain(self, live: set[str]) -> None:
        """Drops the shadows of sequences no longer live, freeing their blocks."""
        for request_id in [r for r in self.shadows if r not in live]:
            self.block_manager.free(self.shadows.pop(request_id))

    def propose(self, wanted: list[tuple[Sequence, OutputStream, int]]) -> None:
        """Sets the draft_token_ids of each (sequence, its stream, most drafts) to the tokens the draft
        model samples after it, as many as asked; none for a sequence still being caught up, too far
        behind for what it has left (CATCH_UP_PER_TOKEN_LEFT), or whose shadow finds no free blocks
        (it is dropped and starts afresh later)."""
        drafting: list[tuple[Sequence, OutputStream, int, Sequence]] = []
        pieces: list[tuple[Sequence, int, list[int]]] = []  # the first pass: each shadow's catch-up
        budget = self.catch_up_tokens
        for seq, stream, room in wanted:
            shadow = self._synced_shadow(seq)
            behind = shadow.num_uncomputed_tokens
            if behind > CATCH_UP_PER_TOKEN_LEFT * (seq.params.max_tokens - len(seq.output_token_ids)):
                continue  # too little left to win back catching up (the tail of a batch that shrank)
            length = min(behind, budget)
            if not length or not self.block_manager.append_slots(shadow, length):
                self._drop(shadow)
                continue
            budget -= length
            start = shadow.num_computed_tokens
            pieces.append((shadow, start, shadow.all_token_ids[start : start + length]))
            if length == behind:
                drafting.append((seq, stream, room, shadow))
        if not pieces:
            return
        logits = self._run(pieces)
        for shadow, _, tokens in pieces:
            shadow.num_computed_tokens += len(tokens)
            self.block_manager.commit_computed(shadow)
        caught_up = [i for i, (shadow, _, _) in enumerate(pieces) if not shadow.num_uncomputed_tokens]
        self._draw(drafting, logits[caught_up])
        for ahead in range(1, max((room for _, _, room, _ in drafting), default=0)):
            drafting = [d for d in drafting if d[2] > ahead]
            if not all(self.block_manager.append_slots(shadow, ahead) for _, _, _, shadow in drafting):
                return  # the cache is full: the drafts so far stand
            for seq, _, _, shadow in drafting:
                shadow.draft_token_ids.append(seq.draft_token_ids[-1])
            logits = self._run(
                [
                    (shadow, shadow.num_computed_tokens + ahead - 1, [seq.draft_token_ids[-1]])
                    for seq, _, _, shadow in drafting
                ]
            )
            self._draw(drafting, logits)

    def _synced_shadow(self, seq: Sequence) -> Sequence:
        """The sequence's shadow with its output: the drafts fed to the draft model last time that
        the sequence kept count as computed from now on; refused ones' blocks are given back."""
        shadow = self.shadows.get(seq.request_id)
        if shadow is None:
            shadow = Sequence(seq.request_id, list(seq.prompt_token_ids), seq.params, seq.seed)
            shadow.num_computed_tokens = self.block_manager.allocate_cached_prefix(shadow)
            self.shadows[seq.request_id] = shadow
        fed, new = shadow.draft_token_ids, seq.output_token_ids[len(shadow.output_token_ids) :]
        kept = next((i for i, (a, b) in enumerate(zip(fed, new)) if a != b), min(len(fed), len(new)))
        shadow.num_computed_tokens += kept
        shadow.output_token_ids = list(seq.output_token_ids)
        shadow.draft_token_ids = []
        self.block_manager.release_beyond(shadow, shadow.num_computed_tokens)
        return shadow

    def _drop(self, shadow: Sequence) -> None:
        self.block_manager.free(shadow)
        del self.shadows[shadow.request_id]

    def _run(self, pieces: list[tuple[Sequence, int, list[int]]]) -> torch.Tensor:
        """One forward pass of the draft model over (shadow, first position, tokens) pieces; the
        logits of each piece's last token."""
        input_ids: list[int] = []
        positions: list[int] = []
        last_rows: list[int] = []
        for _, start, tokens in pieces:
            input_ids += tokens
            positions += range(start, start + len(tokens))
            last_rows.append(len(input_ids) - 1)
        tables = [[list(shadow.block_tables[group]) for shadow, _, _ in pieces] for group in range(self.groups)]
        starts = [start for _, start, _ in pieces]
        return self.runner.run(
            StepBatch(input_ids, positions, [len(t) for _, _, t in pieces], starts, tables, last_rows)
        )

    def _draw(self, drafting: list[tuple[Sequence, OutputStream, int, Sequence]], logits: torch.Tensor) -> None:
        """Appends to each sequence's drafts the token it draws after its tokens and drafts so far,
        from the draft model's logits (one row each, in order) over the target's vocabulary."""
        rows = [
            SamplingRow.after(seq, seq.draft_token_ids, stream.banned_token_ids(len(seq.draft_token_ids)))
            for seq, stream, _, _ in drafting
        ]
        drawn = sample(logits[:, : self.vocab_size], [row.without_logprobs() for row in rows])
        for (seq, _, _, _), token in zip(drafting, drawn):
            seq.draft_token_ids.append(token.token_id)
