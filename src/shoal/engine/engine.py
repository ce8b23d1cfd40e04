"""LLMEngine: add requests, call step(), get outputs. Synchronous; see async_engine for streaming."""

from __future__ import annotations

import functools
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NoReturn

import torch

from shoal.config.engine import EngineConfig
from shoal.engine.batch_controller import BatchSizeController
from shoal.engine.draft_model import DraftModel
from shoal.engine.embedding_run import embed_prompts
from shoal.engine.grammar import GrammarCompiler
from shoal.engine.kv_event_log import KvEventLog
from shoal.engine.kv_layout import KVLayout, KVLayoutMismatch, model_fingerprint
from shoal.engine.kv_tier import KVTier, TierCounters, TierLink, open_tier
from shoal.engine.kv_transfer import KVBlocks, export_prefix, import_blocks
from shoal.engine.memory_fit import check_fits
from shoal.engine.observer import RequestObserver
from shoal.engine.output_stream import OutputStream
from shoal.engine.outputs import CompletionOutput, RequestOutput
from shoal.engine.replica import build_replica
from shoal.engine.sampler import SampledToken, SamplingRow, sample
from shoal.engine.sampling_params import SamplingParams
from shoal.engine.scheduler import ScheduledChunk, Scheduler, batch_of
from shoal.engine.sequence import SCHEDULING_CLASSES, Sequence
from shoal.engine.speculation import Speculation
from shoal.engine.speed import SpeedEstimator
from shoal.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    EngineRequestError,
    InvalidRequestError,
    PromptTooLongError,
    ReplicaFailedError,
)
from shoal.model.loader import Checkpoint, load_checkpoint
from shoal.model.lora_registry import LoraCounters, LoraRegistry
from shoal.runner.devices import keeps_quantized, resolve_device, resolve_dtype
from shoal.runner.step_batch import StepBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    """Counters and gauges for metrics and load reports.

    prefix_cache_hit_tokens counts prompt tokens found cached; prompt_tokens counts the prompt tokens
    of requests that reached their first token (vLLM's meaning), prompt_tokens_computed the tokens
    actually run through prefill (recomputation included). Outstanding prefill tokens are prompt
    tokens not yet in the KV cache; outstanding decode tokens are what max_tokens still allows.
    kv_blocks_exported and kv_blocks_imported count KV blocks sent to and taken from other engines.
    kv_tier counts the KV tier's hits, misses and evictions, and the blocks it holds, by level.
    """

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_kv_blocks: int
    num_free_blocks: int
    block_size: int
    max_cached_tokens: int
    free_cached_tokens: int
    prefix_cache_query_tokens: int
    prefix_cache_hit_tokens: int
    num_preemptions: int
    batch_size_limit: int
    prompt_tokens: int
    prompt_tokens_computed: int
    generation_tokens: int
    outstanding_prefill_tokens: int
    outstanding_decode_tokens: int
    prefill_tokens_per_s: float | None
    decode_tokens_per_s: float | None
    decode_tokens_per_step: float | None
    decode_step_s: float | None
    decode_step_noise: float | None
    kv_blocks_exported: int = 0
    kv_blocks_imported: int = 0
    kv_tier: TierCounters | None = None  # None: no KV tier
    spec_decode_num_drafts: int = 0  # verifications with drafts, their draft tokens, and those kept
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    lora: LoraCounters | None = None  # None: LoRA is off


class LLMEngine:
    """One model replica's engine.

    Invariants: every request id maps to exactly one live Sequence until it finishes; a failing
    request (bad input) raises before it is queued and never affects the others.
    """

    def __init__(
        self,
        config: EngineConfig,
        checkpoint: Checkpoint | None = None,
        on_replica_failure: Callable[[str], None] | None = None,
    ):
        """on_replica_failure is called (from another thread) if a process of a multi-process
        replica dies; steps raise ReplicaFailedError from then on."""
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = resolve_device(config)
        self.dtype = resolve_dtype(config, self.device)
        keep_quantized = keeps_quantized(config, self.device)
        if checkpoint is None:  # refused before any weight is read, with the figures
            check_fits(config.model, self.dtype, keep_quantized, config.kv_cache_bytes or 0, self.device)
        self.checkpoint = checkpoint or load_checkpoint(config.model, self.dtype, config.cache_dir, keep_quantized)
        model_config = self.checkpoint.config
        self.tokenizer = self.checkpoint.tokenizer
        self.max_model_len = config.max_model_len or model_config.max_position_embeddings
        if self.max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's "
                f"{model_config.max_position_embeddings} positions"
            )
        self.on_replica_failure = on_replica_failure
        replica = build_replica(
            config,
            self.checkpoint,
            self.device,
            self.dtype,
            self.max_model_len,
            self._live_sequences,
            on_replica_failure,
        )
        self.model, self.block_manager, self.runner = replica.model, replica.block_manager, replica.runner
        self.loras = replica.loras
        for name, path in config.lora_module_paths():
            self.loras.register(name, path)
        self.tensor_group = replica.tensor_group
        self.kv_cache_budget_bytes = replica.kv_cache_budget_bytes
        self.kv_tier = self._open_tier()
        self.kv_events = self._open_kv_events()
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            config.background_step_tokens,
            config.max_loras,
        )
        self.batch_controller = BatchSizeController(config.max_num_seqs, config.itl_target_ms)
        self.eos_token_ids = tuple(sorted(set(self.tokenizer.eos_token_ids) | set(model_config.eos_token_ids)))
        self.grammars = GrammarCompiler(self.tokenizer, model_config.vocab_size, self.eos_token_ids)
        self.speculation = Speculation(config.speculative, self.max_model_len, self.grammars, self._draft_model())
        self.sequences: dict[str, Sequence] = {}
        self.streams: dict[str, OutputStream] = {}
        self.prompts: dict[str, str | None] = {}
        self._seed_source = random.Random(config.seed)
        # Micro-batches submitted and not yet collected: (runner handle, chunks, submission time).
        self.in_flight: deque[tuple[object, list[ScheduledChunk], float]] = deque()
        self._last_collected = 0.0
        self.speed = SpeedEstimator()
        # How long the step being collected should take (read by other threads: one attribute).
        self.step_expected_s: float | None = None
        self.observer: RequestObserver | None = None
        self.reset_counters()
        log.info(
            "engine ready: model=%s dtype=%s device=%s kv_blocks=%d (%d tokens)",
            config.model,
            self.dtype,
            self.device,
            self.block_manager.num_blocks,
            self.max_cached_tokens,
        )

    def _draft_model(self) -> DraftModel | None:
        """The method draft_model's model, its KV cache given the target's budget in bytes."""
        if self.config.speculative.method != "draft_model":
            return None
        return DraftModel(
            self.config,
            self.tokenizer,
            self.model.config.vocab_size,
            self.device,
            self.dtype,
            self.max_model_len,
            self.kv_cache_budget_bytes,
        )

    def reset_counters(self) -> None:
        """Zeroes the cumulative counters (after calibration, so metrics count served work only)."""
        self.prompt_tokens = 0
        self.prompt_tokens_computed = 0
        self.generation_tokens = 0
        self.kv_blocks_exported = self.kv_blocks_imported = 0
        self.block_manager.prefix_queries = self.block_manager.prefix_hits = 0
        self.scheduler.num_preemptions = 0
        if self.kv_tier is not None:
            self.kv_tier.reset_counters()

    @functools.cached_property
    def max_cached_tokens(self) -> int:
        """The longest sequence the KV cache holds, counted per KV group (a windowed group holds
        only its window's blocks); at most every block's tokens."""
        return self._tokens_fitting(self.block_manager.num_usable_blocks)

    @property
    def free_cached_tokens(self) -> int:
        """The longest sequence the free KV blocks would hold, counted as max_cached_tokens is."""
        return self._tokens_fitting(self.block_manager.num_free_blocks)

    def _tokens_fitting(self, blocks: int) -> int:
        bm = self.block_manager
        return bm.groups.tokens_fitting(blocks, bm.block_size, bm.num_usable_blocks * bm.block_size)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        resume_token_ids: list[int] | None = None,
        scheduling: str = "interactive",
        resume_text_offset: int | None = None,
        lora: str | None = None,
    ) -> Sequence:
        """Validates, tokenizes and queues a request; raises InvalidRequestError subclasses on bad input.

        resume_token_ids continues a request that another engine started: those output tokens are
        taken as already generated (they count toward max_tokens, penalties and stop strings, and
        are not streamed again). With the same seed the rest of the output is what the first
        engine would have produced. `scheduling` is the request's class (sequence.SCHEDULING_CLASSES).
        `lora` names the LoRA adapter it runs (ModelNotFoundError for one this engine does not know).
        """
        params = params or SamplingParams()
        if scheduling not in SCHEDULING_CLASSES:
            raise ValueError(f"unknown scheduling class {scheduling!r}")
        if request_id in self.sequences:
            raise DuplicateRequestError(f"request id {request_id!r} is already running", param="request_id")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        resumed = list(resume_token_ids or [])
        self._validate_prompt(token_ids, resumed, params)
        seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
        seq = Sequence(request_id, token_ids, params, seed, scheduling, output_token_ids=resumed)
        if lora is not None:
            if self.loras is None:
                raise InvalidRequestError(f"this engine serves no LoRA adapters (asked for {lora!r})", param="model")
            self.loras.check(lora)
            seq.lora, seq.cache_salt = lora, self.loras.salt(lora)
        matcher = self.grammars.matcher(params.structured_outputs) if params.structured_outputs else None
        stream = OutputStream(self.tokenizer, params, token_ids, self.eos_token_ids, self.max_model_len, matcher)
        stream.resume(resumed, resume_text_offset)
        self.sequences[request_id] = seq
        self.streams[request_id] = stream
        self.prompts[request_id] = prompt if isinstance(prompt, str) else None
        self.scheduler.add(seq)
        return seq

    def _validate_prompt(self, token_ids: list[int], resumed: list[int], params: SamplingParams) -> None:
        if not token_ids:
            raise EmptyPromptError("the prompt is empty", param="prompt")
        vocab = self.model.config.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids + resumed):
            raise InvalidRequestError(f"token ids must be integers in [0, {vocab})", param="prompt")
        if any(token >= vocab for token, _ in params.logit_bias):
            raise InvalidRequestError(f"logit_bias names token ids outside [0, {vocab})", param="logit_bias")
        if len(resumed) >= params.max_tokens:
            raise InvalidRequestError("resume_token_ids already reach max_tokens", param="resume_token_ids")
        limit = min(self.max_model_len, self.max_cached_tokens)
        if len(token_ids) + len(resumed) >= limit:
            raise PromptTooLongError(
                f"the prompt has {len(token_ids) + len(resumed)} tokens; this model accepts at "
                f"most {limit - 1} so that one token can be generated",
                param="prompt",
            )

    def load_lora_adapter(self, name: str, path: str, sha256: str | None = None) -> None:
        """Reads, checks and holds a LoRA adapter under `name` (model.lora_registry). Call between
        steps (the engine's own thread)."""
        self.lora_registry().register(name, path, sha256)

    def unload_lora_adapter(self, name: str) -> None:
        """Forgets an adapter for new requests; those running it go on with it until they end."""
        self.lora_registry().unregister(name, running=any(seq.lora == name for seq in self.sequences.values()))

    def lora_registry(self) -> LoraRegistry:
        """The LoRA adapters this engine serves; InvalidRequestError where it serves none."""
        if self.loras is None:
            raise InvalidRequestError("this engine serves no LoRA adapters (enable_lora is off)", param="lora_name")
        return self.loras

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """Stops a request now and frees its blocks; returns its final output (finish_reason abort)."""
        seq = self.scheduler.abort(request_id)
        return self._output(seq, [], "") if seq else None

    def shutdown(self) -> None:
        """Stops the replica's other processes, if it has any, and keeps the KV tier on disk."""
        self.runner.shutdown()
        if self.kv_tier is not None:
            self.kv_tier.close()

    def _open_tier(self) -> KVTier | None:
        """The KV tier the config asks for, linked under the block manager (None: no tier)."""
        if not self.moves_kv:
            if self.config.kv_tier_host_bytes or self.config.kv_tier_disk_bytes:
                log.warning("no KV tier: a multi-process replica's cache is spread over its processes")
            return None
        tier = open_tier(self.config, self.kv_layout, self.runner.kv_caches)
        if tier is not None:
            self.block_manager.tier = TierLink(tier, self.runner.kv_caches)
        return tier

    def _open_kv_events(self) -> KvEventLog | None:
        """The log of what the prefix cache and its tier gain and lose, where it is one KV group."""
        manager = self.block_manager
        if not (self.config.kv_events and manager.enable_prefix_caching and manager.groups.count == 1):
            return None
        events = KvEventLog()
        manager.events = events
        if self.kv_tier is not None:
            self.kv_tier.publish_to(events)
        return events

    def interrupt(self) -> None:
        """From another thread: a step waiting on the replica's other processes gives up."""
        self.runner.interrupt()

    def _batch(self, chunks: list[ScheduledChunk]) -> StepBatch:
        return batch_of(chunks, self.block_manager.groups.count)

    def _live_sequences(self) -> list[tuple[list[int], int]]:
        """(block table, tokens in the KV cache) of every sequence holding blocks, for a pipeline
        (whose one KV group keeps full-length tables: shoal.parallel.pipeline_kv_groups)."""
        return [(list(seq.block_tables[0]), seq.num_computed_tokens) for seq in self.scheduler.running]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self.in_flight)

    def step(self) -> list[RequestOutput]:
        """Runs one iteration: schedules and submits micro-batches while the runner has room for
        them in flight (one, unless it is a pipeline), then takes the oldest one's logits: sample,
        detokenize, retire finished requests.

        If the forward pass or sampling raises, the failure is pinned on the requests that fail
        alone (those finish with an error); the others keep their state and continue next step.
        """
        outputs = self._submit_micro_batches()
        outputs += [
            self._output(seq, [], self.streams[seq.request_id].take_new_text()) for seq in self.scheduler.outgrown
        ]
        self.scheduler.outgrown.clear()
        if not self.in_flight:
            return outputs
        handle, chunks, submitted = self.in_flight.popleft()
        sampling = [c for c in chunks if c.completes_sequence]  # the logits' rows, in order
        spans, row = [], 0  # each sampling chunk's rows: its last token's, then one per draft
        for chunk in sampling:
            spans.append(range(row, row + 1 + len(chunk.seq.draft_token_ids)))
            row += len(spans[-1])
        live = [i for i, c in enumerate(sampling) if not c.seq.is_finished]  # not aborted while in flight
        rows = [r for i in live for r in spans[i]]
        chunks = [c for c in chunks if not c.seq.is_finished]
        completing = [sampling[i] for i in live]
        prefill_tokens, decode_tokens = _split_work(chunks)
        self.step_expected_s = self.speed.step_seconds(prefill_tokens, decode_tokens)
        produced = 0  # tokens given to the decoding sequences
        try:
            logits = self.runner.collect(handle)
            sampled = self._sample(completing, logits if len(rows) == row else logits[rows])
            stage_times = self.runner.stage_times(handle)
        except ReplicaFailedError as exc:
            self._replica_failed(exc)
        except Exception as exc:
            return outputs + self._fail_culprits(chunks, exc)
        if self.config.step_delay_ms:
            time.sleep(self.config.step_delay_ms / 1e3)
        finished_at = time.perf_counter()
        elapsed = finished_at - max(submitted, self._last_collected)
        self._last_collected = finished_at
        for chunk in chunks:  # drafts' KV counts once they are kept, below
            chunk.seq.num_computed_tokens += chunk.length - len(chunk.seq.draft_token_ids)
            self.block_manager.commit_computed(chunk.seq)
        self.prompt_tokens_computed += prefill_tokens
        now = time.monotonic()
        for chunk, tokens in zip(completing, sampled):
            seq = chunk.seq
            if seq.first_token_time is None:
                seq.first_token_stage_times = stage_times
            stream = self.streams[seq.request_id]
            kept = self.speculation.keep(seq, tokens)
            for index, token in enumerate(kept):
                seq.num_computed_tokens += index > 0  # the draft before this token was kept: its KV holds
                seq.output_token_ids.append(token.token_id)
                self.generation_tokens += 1
                self._observe_token(seq, now)
                stream.append(token)
                if stream.finish_reason:
                    kept = kept[: index + 1]
                    break
            produced += len(kept) if len(seq.output_token_ids) > len(kept) else 0
            seq.draft_token_ids.clear()
            if stream.finish_reason:
                self.scheduler.finish(seq, stream.finish_reason)
                seq.stop_reason = stream.stop_reason
            elif len(tokens) > 1:
                self.block_manager.commit_computed(seq)
                self.block_manager.release_beyond(seq, seq.num_tokens)
            output = self._output(seq, [t.token_id for t in kept], stream.take_new_text())
            if stream.finish_reason == "error":
                output.error = InvalidRequestError(
                    f"the output's grammar allows no token of this model's vocabulary after "
                    f"{len(seq.output_token_ids) - 1} tokens ({stream.matcher.get_error().splitlines()[0]})",
                    param=seq.params.structured_outputs.param,
                )
            outputs.append(output)
        self.speed.observe(prefill_tokens, decode_tokens, elapsed, produced)
        if any(c.length == 1 for c in completing):
            self.batch_controller.observe(elapsed * 1e3, len(chunks), len(self.scheduler.waiting))
        return outputs

    def _submit_micro_batches(self) -> list[RequestOutput]:
        """Fills the runner's micro-batches in flight; returns the outputs of requests failed on
        the way."""
        outputs: list[RequestOutput] = []
        depth = self.runner.depth
        in_flight = frozenset(c.seq.request_id for _, chunks, _ in self.in_flight for c in chunks)
        self.speculation.propose(self.scheduler, self.streams, in_flight)
        # Sequences share the micro-batches evenly, so that every stage has one to work on.
        share = -(-(len(self.scheduler.running) + len(self.scheduler.waiting)) // depth) if depth > 1 else None
        while len(self.in_flight) < depth:
            busy = frozenset(c.seq.request_id for _, chunks, _ in self.in_flight for c in chunks)
            chunks = self.scheduler.schedule(self.batch_controller.limit, busy, max_chunks=share)
            if not chunks:
                break
            now = time.monotonic()
            for chunk in chunks:
                if chunk.seq.first_scheduled_time is None:
                    chunk.seq.first_scheduled_time = now
            try:
                self.in_flight.append((self.runner.submit(self._batch(chunks)), chunks, time.perf_counter()))
            except ReplicaFailedError as exc:
                self._replica_failed(exc)
            except Exception as exc:
                outputs += self._fail_culprits(chunks, exc)
        return outputs

    def _replica_failed(self, exc: ReplicaFailedError) -> NoReturn:
        """No request is to blame, and none can run here any more."""
        if self.on_replica_failure is not None:
            self.on_replica_failure(str(exc))
        raise exc

    def _forward_and_sample(self, chunks: list[ScheduledChunk]) -> list[list[SampledToken]]:
        return self._sample([c for c in chunks if c.completes_sequence], self.runner.run(self._batch(chunks)))

    def _sample(self, completing: list[ScheduledChunk], logits: torch.Tensor) -> list[list[SampledToken]]:
        """Tokens for the chunks that complete their sequence, from their rows of `logits`: for each,
        the token after its last one, then the token after each of its drafts as if the drafts
        before it were its output (each drawn at its own position, so exactly the token the
        sequence would sample there). A sequence with a grammar samples only among the tokens its
        matcher allows at each place (after the drafts before it, which the grammar accepts)."""
        streams = [self.streams[c.seq.request_id] for c in completing]
        constrained = [i for i, stream in enumerate(streams) if stream.matcher is not None]
        masks: dict[tuple[int, int], torch.Tensor] = {}  # (chunk, place) -> allowed tokens
        only: dict[tuple[int, int], int | None] = {}
        if constrained:
            allowed, single = self.grammars.allowed_tokens([streams[i].matcher for i in constrained])
            masks.update(((i, 0), mask) for i, mask in zip(constrained, allowed.to(logits.device)))
            only.update(((i, 0), token) for i, token in zip(constrained, single))
            for i in (i for i in constrained if completing[i].seq.draft_token_ids):
                allowed, single = self.grammars.allowed_after(streams[i].matcher, completing[i].seq.draft_token_ids)
                masks.update(((i, ahead), mask) for ahead, mask in enumerate(allowed.to(logits.device), 1))
                only.update(((i, ahead), token) for ahead, token in enumerate(single, 1))
        rows, owners = [], []
        for i, (c, stream) in enumerate(zip(completing, streams)):
            drafts = c.seq.draft_token_ids
            for ahead in range(1 + len(drafts)):
                rows.append(
                    SamplingRow.after(
                        c.seq,
                        drafts[:ahead],
                        stream.banned_token_ids(ahead),
                        masks.get((i, ahead)),
                        only.get((i, ahead)),
                    )
                )
                owners.append(i)
        sampled: list[list[SampledToken]] = [[] for _ in completing]
        for owner, token in zip(owners, sample(logits, rows)):
            sampled[owner].append(token)
        return sampled

    def _fail_culprits(self, chunks: list[ScheduledChunk], exc: Exception) -> list[RequestOutput]:
        """Re-runs each chunk alone (nothing is committed, so this only costs time) and fails the
        requests that still raise. If none does, the fault is not any one request's: the whole
        batch fails, and the engine carries on with the next requests."""
        log.warning("engine step failed (%s: %s); isolating the failing requests", type(exc).__name__, exc)
        culprits = []
        for chunk in chunks:
            try:
                self._forward_and_sample([chunk])
            except Exception as alone:
                culprits.append((chunk.seq, alone))
        if not culprits:
            culprits = [(chunk.seq, exc) for chunk in chunks]
        outputs = []
        for seq, error in culprits:
            log.error("request %s failed in the engine: %s: %s", seq.request_id, type(error).__name__, error)
            self.scheduler.finish(seq, "error")
            output = self._output(seq, [], "")
            output.error = EngineRequestError(f"{type(error).__name__}: {error}")
            outputs.append(output)
        return outputs

    def _observe_token(self, seq: Sequence, now: float) -> None:
        if seq.first_token_time is None:
            seq.first_token_time = now
            self.prompt_tokens += seq.num_tokens - 1
            if self.observer:
                self.observer.first_token(seq, now - seq.arrival_time)
        elif self.observer:
            self.observer.next_token(seq, now - seq.last_token_time)
        seq.last_token_time = now

    def _output(self, seq: Sequence, new_tokens: list[int], new_text: str) -> RequestOutput:
        stream = self.streams[seq.request_id]
        completion = CompletionOutput(
            index=0,
            text=stream.text if seq.is_finished else stream.text[: stream.emitted],
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=stream.cumulative_logprob if stream.logprobs is not None else None,
            logprobs=stream.logprobs,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            kept_drafts=seq.kept_drafts,
            refused_drafts=seq.refused_drafts,
        )
        out = RequestOutput(
            seq.request_id,
            self.prompts[seq.request_id],
            seq.prompt_token_ids,
            [completion],
            seq.is_finished,
            seq.seed,
            seq.num_cached_tokens,
            new_tokens,
            new_text,
        )
        if seq.is_finished:
            if self.observer:
                self.observer.finished(seq, time.monotonic() - seq.arrival_time)
            self._forget(seq.request_id)
        return out

    def _forget(self, request_id: str) -> None:
        seq = self.sequences.pop(request_id)
        del self.streams[request_id], self.prompts[request_id]
        if seq.lora is not None and self.loras.retiring:
            self.loras.retire({s.lora for s in self.sequences.values()})

    def stats(self) -> EngineStats:
        """A snapshot; call it from the thread that steps the engine."""
        bm = self.block_manager
        prefill, decode = self.scheduler.outstanding_tokens()
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=bm.usage(),
            num_kv_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            block_size=bm.block_size,
            max_cached_tokens=self.max_cached_tokens,
            free_cached_tokens=self.free_cached_tokens,
            prefix_cache_query_tokens=bm.prefix_queries,
            prefix_cache_hit_tokens=bm.prefix_hits,
            num_preemptions=self.scheduler.num_preemptions,
            batch_size_limit=self.batch_controller.limit,
            prompt_tokens=self.prompt_tokens,
            prompt_tokens_computed=self.prompt_tokens_computed,
            generation_tokens=self.generation_tokens,
            outstanding_prefill_tokens=prefill,
            outstanding_decode_tokens=decode,
            prefill_tokens_per_s=self.speed.prefill_tokens_per_s,
            decode_tokens_per_s=self.speed.decode_tokens_per_s,
            decode_tokens_per_step=self.speed.decode_tokens_per_step,
            decode_step_s=self.speed.decode_step_s,
            decode_step_noise=self.speed.decode_step_noise,
            kv_blocks_exported=self.kv_blocks_exported,
            kv_blocks_imported=self.kv_blocks_imported,
            kv_tier=self.kv_tier.counters() if self.kv_tier is not None else None,
            spec_decode_num_drafts=self.speculation.drafts,
            spec_decode_num_draft_tokens=self.speculation.draft_tokens,
            spec_decode_num_accepted_tokens=self.speculation.accepted_draft_tokens,
            lora=self.loras.counters() if self.loras is not None else None,
        )

    @functools.cached_property
    def kv_layout(self) -> KVLayout:
        """What another engine's KV blocks must match to be imported here."""
        cfg = self.model.config
        return KVLayout(
            model_fingerprint(cfg, self.model),
            str(self.dtype).removeprefix("torch."),
            self.block_manager.block_size,
            len(self.model.kv_slots),
            self.model.kv_groups.count,
            cfg.num_kv_heads,
            cfg.head_dim,
        )

    def export_kv(self, token_ids: list[int]) -> KVBlocks:
        """The KV of the longest cached prefix of `token_ids` (whole blocks), for another engine.
        Call between steps (the engine's own thread)."""
        exported = export_prefix(self.kv_layout, self.block_manager, self._one_process_caches(), token_ids)
        self.kv_blocks_exported += len(exported.hashes)
        return exported

    def import_kv(self, incoming: KVBlocks) -> int:
        """Adds another engine's KV blocks to this one's prefix cache; returns the blocks imported
        (those not cached here already). Call between steps (the engine's own thread)."""
        imported = import_blocks(self.kv_layout, self.block_manager, self._one_process_caches(), incoming)
        self.kv_blocks_imported += imported
        return imported

    def embed(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """Each prompt's embedding (float32 [hidden]), pooled as the config says (embedding_run).
        Call between steps (the engine's own thread). InvalidRequestError for a prompt that is empty,
        has ids outside the vocabulary or does not fit the context; a parallel replica's hidden
        states are spread over its processes, so it computes none."""
        if not self.moves_kv:
            raise InvalidRequestError("embeddings come from a one-process replica", param="model")
        for prompt in prompts:
            self._validate_prompt(prompt, [], SamplingParams(max_tokens=1))
        manager = self.block_manager
        if max(manager.blocks_needed(len(p)) for p in prompts) * manager.groups.count > manager.num_free_blocks:
            raise InvalidRequestError("the input does not fit the free KV cache now; retry shortly", param="input")
        return embed_prompts(self, prompts, self.config.embedding_pooling, self.config.embedding_normalize)

    @property
    def moves_kv(self) -> bool:
        """Whether KV blocks can be exported from and imported into this engine (a one-process
        replica: a parallel replica's cache is spread over its processes)."""
        return self.config.tensor_parallel_size == 1 and self.config.pipeline_parallel_size == 1

    def _one_process_caches(self) -> list:
        if not self.moves_kv:
            raise KVLayoutMismatch("KV blocks move only to and from a one-process replica")
        return self.runner.kv_caches

    def check_integrity(self) -> None:
        """Asserts the block manager's and scheduler's invariants (used by tests)."""
        live = list(self.scheduler.running)
        for seq in self.scheduler.waiting:
            assert not seq.block_tables, f"waiting {seq.request_id} holds blocks"
        assert {s.request_id for s in live} | {s.request_id for s in self.scheduler.waiting} == set(self.sequences)
        self.block_manager.check_integrity(live)


def _split_work(chunks: list[ScheduledChunk]) -> tuple[int, int]:
    """(prompt tokens, decoding sequences) of a micro-batch: everything but the newest sampled token
    of a decoding sequence and its drafts is prompt (or recomputed) work."""
    decoding = [c for c in chunks if c.completes_sequence and c.seq.output_token_ids]
    scored = sum(1 + len(c.seq.draft_token_ids) for c in decoding)
    return sum(c.length for c in chunks) - scored, len(decoding)
