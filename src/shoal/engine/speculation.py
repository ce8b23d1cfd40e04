"""Speculative decoding's drafting and keeping: which sequences draft, how many tokens, from where
(a request's predicted output, else the engine's method: prompt lookup, engine.ngram_drafter, or a
draft model, engine.draft_model), and which drafts a step keeps. A draft is kept exactly when it is
the token its sequence sampled itself at that place, so speculation changes the speed, never the
tokens."""

from __future__ import annotations

from shoal.config.speculative import SpeculativeConfig
from shoal.engine.draft_model import DraftModel
from shoal.engine.grammar import GrammarCompiler
from shoal.engine.ngram_drafter import ngram_draft, predicted_draft
from shoal.engine.output_stream import OutputStream
from shoal.engine.sampler import SampledToken
from shoal.engine.scheduler import Scheduler
from shoal.engine.sequence import Sequence

DRAFT_PAUSE_STEPS = 8  # steps a sequence drafts nothing after a refused single draft


class Speculation:
    """Invariants: `drafts` counts the verifications that had drafts, `draft_tokens` their draft
    tokens and `accepted_draft_tokens` those kept (vLLM's spec_decode counters); a sequence's
    draft_token_ids are set here before a step and cleared by the engine after it."""

    def __init__(
        self, config: SpeculativeConfig, max_model_len: int, grammars: GrammarCompiler, draft_model: DraftModel | None
    ):
        """`draft_model` is the method draft_model's (None for the others)."""
        self.config = config
        self.grammars = grammars
        self.max_model_len = max_model_len
        self.draft_model = draft_model
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_draft_tokens = 0

    def propose(self, scheduler: Scheduler, streams: dict[str, OutputStream], in_flight: frozenset[str]) -> None:
        """Drafts for every decoding sequence, as many as fit its max_tokens and the context: from its
        predicted output where the request gave one, else the tokens its grammar forces next where it
        forces some, else by the method (none: no drafts); under a grammar, only as far as the
        grammar accepts them. Sequences `in_flight` (in a pipeline's micro-batches) keep the drafts
        they were sent with. None while more sequences run than disable_by_batch_size, or while a
        prompt is prefilled or waits to be: such a step is compute-bound, and drafts would slow it."""
        config, running = self.config, scheduler.running
        if self.draft_model is not None:
            self.draft_model.retain({seq.request_id for seq in running})
        drafting = [seq for seq in running if seq.request_id not in in_flight]
        for seq in drafting:  # drafts a pipeline left unscheduled are stale
            seq.draft_token_ids = []
        if (
            len(running) > config.disable_by_batch_size
            or scheduler.waiting
            or not (config.method or any(seq.params.predicted_token_ids for seq in running))
            or any(seq.num_uncomputed_tokens > 1 for seq in running)
        ):
            return
        for_the_model = []
        for seq in drafting:
            predicted = seq.params.predicted_token_ids
            matcher = streams[seq.request_id].matcher
            if not (predicted or config.method):
                continue
            if seq.draft_pause:
                seq.draft_pause -= 1
                continue
            room = min(
                config.num_speculative_tokens if seq.draft_limit is None else seq.draft_limit,
                seq.params.max_tokens - len(seq.output_token_ids) - 1,
                self.max_model_len - seq.num_tokens,
            )
            if room < 1:
                continue
            if predicted:
                seq.draft_token_ids = predicted_draft(
                    list(predicted), seq.output_token_ids, room, config.prompt_lookup_max
                )
            elif matcher is not None and (forced := matcher.compute_ff_tokens()):
                seq.draft_token_ids = forced[:room]
            elif self.draft_model is not None:
                for_the_model.append((seq, streams[seq.request_id], room))
            else:
                seq.draft_token_ids = ngram_draft(
                    seq.all_token_ids, room, config.prompt_lookup_min, config.prompt_lookup_max
                )
        if for_the_model:
            self.draft_model.propose(for_the_model)
        for seq in drafting:
            matcher = streams[seq.request_id].matcher
            if matcher is not None and seq.draft_token_ids:
                seq.draft_token_ids = self.grammars.accepted_drafts(matcher, seq.draft_token_ids)

    def keep(self, seq: Sequence, tokens: list[SampledToken]) -> list[SampledToken]:
        """The sampled tokens up to the first that differs from the draft in its place (that one
        included): a draft is kept exactly when it is the token the sequence sampled itself."""
        drafts = seq.draft_token_ids
        kept = next((j for j, draft in enumerate(drafts) if tokens[j].token_id != draft), len(drafts))
        self.drafts += bool(drafts)
        self.draft_tokens += len(drafts)
        self.accepted_draft_tokens += kept
        seq.kept_drafts += kept
        seq.refused_drafts += len(drafts) - kept
        if drafts:
            self._adapt(seq, len(drafts), kept)
        return tokens[: kept + 1]

    def _adapt(self, seq: Sequence, drafted: int, kept: int) -> None:
        """A sequence drafts one more token than it last kept (up to num_speculative_tokens); one
        whose single draft was refused drafts nothing for DRAFT_PAUSE_STEPS steps, so text that
        does not repeat costs next to nothing."""
        seq.draft_limit = min(self.config.num_speculative_tokens, kept + 1)
        if drafted == 1 and not kept:
            seq.draft_pause = DRAFT_PAUSE_STEPS
