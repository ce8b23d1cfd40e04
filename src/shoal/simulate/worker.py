"""A simulated worker: the engine's own scheduler and block manager, with the forward pass replaced
by the step-cost model, and its KV tier by shoal.simulate.kv_tier."""

from __future__ import annotations

from typing import Protocol

from shoal.engine.block_manager import BlockManager
from shoal.engine.kv_event_log import KvEventLog
from shoal.engine.sampling_params import SamplingParams
from shoal.engine.scheduler import ScheduledChunk, Scheduler
from shoal.engine.sequence import Sequence
from shoal.engine.speed import SpeedEstimator
from shoal.protocol.prefix_keys import canonical_chat
from shoal.protocol.worker_load import CalibrationFigures, WorkerLoad
from shoal.simulate.events import EventLoop
from shoal.simulate.fleet import WorkerSpec
from shoal.simulate.host import Host
from shoal.simulate.kv_tier import SimulatedTier
from shoal.simulate.tokens import SimRequest
from shoal.worker.prompt_keys import prompt_keys

BLOCK_SIZE = 16  # the engine's default


class WorkerListener(Protocol):
    """What the router hears from a worker (the stream's events)."""

    def first_token(self, worker_id: str, seq: Sequence) -> None: ...

    def finished(self, worker_id: str, seq: Sequence, error: str | None) -> None: ...


class SimWorker:
    """One replica. Steps follow each other without a gap while there is work, as in the engine
    loop: schedule (the real Scheduler: running sequences first, then waiting ones under the
    token budget, preempting by recompute when blocks run out), run for the step cost on its host,
    then commit the computed tokens to the prefix cache and give each sequence whose prompt is
    done one output token. Every request generates exactly its max_tokens (as with ignore_eos).

    Invariants: `stepping` iff a step is in progress on the host; every live sequence is in the
    scheduler and `output_bases`; a failed worker holds nothing and comes back with an empty cache.
    """

    def __init__(
        self, spec: WorkerSpec, host: Host, loop: EventLoop, listener: WorkerListener, kv_events: bool = False
    ):
        self.spec = spec
        self.publishes = kv_events
        self.host = host
        self.loop = loop
        self.listener = listener
        self.up = True
        self._params: dict[int, SamplingParams] = {}
        self.tier = (
            SimulatedTier(
                BLOCK_SIZE,
                spec.tier_host_tokens,
                spec.tier_disk_tokens,
                spec.tier_host_tokens_per_s,
                spec.tier_disk_tokens_per_s,
            )
            if spec.tier_host_tokens or spec.tier_disk_tokens
            else None
        )
        figures = spec.calibration
        self.calibration = CalibrationFigures(
            prefill_tokens_per_s=figures.prefill_tokens_per_s,
            decode_tokens_per_s=figures.decode_tokens_per_s,
            batched_decode_tokens_per_s=figures.batched_decode_tokens_per_s,
            batch=figures.batch,
            capability=figures.batched_decode_tokens_per_s,
        )
        self._empty()

    def _empty(self) -> None:
        spec, calibration = self.spec, self.spec.calibration
        self.block_manager = BlockManager(spec.kv_tokens // BLOCK_SIZE, BLOCK_SIZE)
        self.block_manager.tier = self.tier
        # A new log, a new epoch: a restarted worker's followers take a snapshot.
        self.events = KvEventLog() if self.publishes else None
        if self.events is not None:
            self.block_manager.events = self.events
            if self.tier is not None:
                self.tier.publish_to(self.events)
        self.scheduler = Scheduler(self.block_manager, spec.max_num_seqs, spec.max_num_batched_tokens)
        self.speed = SpeedEstimator()
        self.speed.seed(
            calibration.prefill_tokens_per_s,
            calibration.batched_decode_tokens_per_s,
            calibration.batch / calibration.batched_decode_tokens_per_s,
        )
        self.output_bases: dict[str, int] = {}
        self.stepping = False
        self._step_chunks: list[ScheduledChunk] = []
        self._step_started = 0.0
        self._step_tokens = (0, 0)

    @property
    def max_prompt_tokens(self) -> int:
        """Longer prompts (with resumed output) are refused, as the engine refuses them."""
        return min(self.spec.max_model_len, self.block_manager.num_blocks * BLOCK_SIZE) - 1

    def add(
        self,
        request_id: str,
        prompt: list[int],
        resumed: list[int],
        max_tokens: int,
        output_base: int,
        prefix: tuple[SimRequest, tuple[bytes, ...]] | None = None,
    ) -> None:
        """Queues a request whose i-th output token is `output_base + i` (the first len(resumed)
        of them already generated elsewhere). The caller checks max_prompt_tokens first. A worker
        that publishes KV events announces which of its blocks each of the router's prefix keys
        for the request (`prefix`: the request and those keys) needs."""
        if self.events is not None and prefix is not None:
            self._announce(prompt, *prefix)
        params = self._params.get(max_tokens)
        if params is None:
            params = self._params[max_tokens] = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        seq = Sequence(request_id, prompt, params, seed=0, arrival_time=self.loop.now, output_token_ids=resumed)
        self.output_bases[request_id] = output_base
        self.scheduler.add(seq)
        if not self.stepping:
            self._step()

    def _announce(self, prompt: list[int], request: SimRequest, keys: tuple[bytes, ...]) -> None:
        canonical = canonical_chat(list(request.messages))
        keys, blocks = prompt_keys(keys, canonical, canonical.text, request.token_ends(canonical), BLOCK_SIZE)
        if keys:
            self.events.mapped(self.block_manager.chain(prompt, max(blocks)), keys, blocks)

    def _step(self) -> None:
        chunks = self.scheduler.schedule()
        for seq in self.scheduler.outgrown:
            self._retire(seq, "the sequence outgrew the whole KV cache")
        self.scheduler.outgrown.clear()
        if not chunks:
            self.stepping = False
            return
        decode = sum(1 for c in chunks if c.completes_sequence and c.seq.output_token_ids)
        prefill = sum(c.length for c in chunks) - decode
        self.stepping = True
        self._step_chunks, self._step_started, self._step_tokens = chunks, self.loop.now, (prefill, decode)
        loading = self.tier.take_load_seconds() if self.tier else 0.0  # prefixes copied back from the tier
        self.host.start(
            self.spec.worker_id, self.spec.threads, self.spec.cost.seconds(prefill, decode) + loading, self._step_done
        )

    def _step_done(self) -> None:
        prefill, decode = self._step_tokens
        self.speed.observe(prefill, decode, self.loop.now - self._step_started)
        chunks = self._step_chunks
        for chunk in chunks:
            chunk.seq.num_computed_tokens += chunk.length
            self.block_manager.commit_computed(chunk.seq)
        for chunk in chunks:
            if not chunk.completes_sequence:
                continue
            seq = chunk.seq
            seq.output_token_ids.append(self.output_bases[seq.request_id] + len(seq.output_token_ids))
            if seq.first_token_time is None:
                seq.first_token_time = self.loop.now
                self.listener.first_token(self.spec.worker_id, seq)
            if len(seq.output_token_ids) >= seq.params.max_tokens:
                self.scheduler.finish(seq, "length")
                self._retire(seq, None)
        self._step()

    def _retire(self, seq: Sequence, error: str | None) -> None:
        del self.output_bases[seq.request_id]
        self.listener.finished(self.spec.worker_id, seq, error)

    def fail(self) -> list[Sequence]:
        """The worker dies: returns its live sequences (as they were) and forgets everything."""
        live = list(self.scheduler.running) + list(self.scheduler.waiting)
        self.host.cancel(self.spec.worker_id)
        self.up = False
        if self.tier is not None:
            self.tier.lose_host()
        self._empty()
        return live

    def recover(self) -> None:
        self.up = True

    def load_report(self) -> WorkerLoad:
        """The worker's /load report, as shoal's worker server builds it."""
        bm, speed, calibration = self.block_manager, self.speed, self.spec.calibration
        prefill, decode = self.scheduler.outstanding_tokens()
        return WorkerLoad(
            server="shoal",
            max_model_len=self.spec.max_model_len,
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            max_num_seqs=self.spec.max_num_seqs,
            outstanding_prefill_tokens=prefill,
            outstanding_decode_tokens=decode,
            free_kv_blocks=bm.num_free_blocks,
            num_kv_blocks=bm.num_blocks,
            block_size=BLOCK_SIZE,
            kv_cache_usage=bm.usage(),
            prefill_tokens_per_s=speed.prefill_tokens_per_s,
            decode_tokens_per_s=speed.decode_tokens_per_s,
            decode_step_s=speed.decode_step_s,
            decode_step_noise=speed.decode_step_noise,
            capability=calibration.batched_decode_tokens_per_s,
            calibration=self.calibration,
            kv_tier_tokens=self.tier.capacity_tokens if self.tier else None,
            kv_tier_load_tokens_per_s=self.tier.load_tokens_per_s if self.tier else None,
        )
