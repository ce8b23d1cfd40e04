"""Prometheus metrics of one worker: vLLM's names and meanings with the `shoal:` prefix.

Latency histograms are fed by the engine thread (the worker is the engine's RequestObserver);
gauges and counters are read from the engine's published stats snapshot at scrape time, so a
scrape never touches engine state.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from shoal.engine.async_engine import AsyncLLMEngine
from shoal.engine.kv_tier import TierCounters
from shoal.engine.kv_transfer import KVBlocks
from shoal.engine.sequence import Sequence
from shoal.observability.latency_buckets import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS
from shoal.worker.device_metrics import DeviceCollector

disable_created_metrics()  # no *_created series, as in vLLM

KV_TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


# (kind, name under shoal:, help, EngineStats field); counters get "_total" appended on exposition.
ENGINE_SERIES = (
    (GaugeMetricFamily, "num_requests_running", "Requests in the running batch.", "num_running"),
    (GaugeMetricFamily, "num_requests_waiting", "Requests waiting to be scheduled.", "num_waiting"),
    (GaugeMetricFamily, "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", "kv_cache_usage"),
    (
        CounterMetricFamily,
        "prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache.",
        "prefix_cache_query_tokens",
    ),
    (CounterMetricFamily, "prefix_cache_hits", "Prompt tokens found in the prefix cache.", "prefix_cache_hit_tokens"),
    (CounterMetricFamily, "prompt_tokens", "Prompt tokens of requests that were prefilled.", "prompt_tokens"),
    (
        CounterMetricFamily,
        "prompt_tokens_computed",
        "Tokens run through prefill (not found in the cache; recomputation included).",
        "prompt_tokens_computed",
    ),
    (CounterMetricFamily, "generation_tokens", "Tokens generated.", "generation_tokens"),
    (CounterMetricFamily, "num_preemptions", "Sequences preempted (recomputed later).", "num_preemptions"),
    (CounterMetricFamily, "spec_decode_num_drafts", "Verifications of speculative drafts.", "spec_decode_num_drafts"),
    (
        CounterMetricFamily,
        "spec_decode_num_draft_tokens",
        "Speculative draft tokens verified.",
        "spec_decode_num_draft_tokens",
    ),
    (
        CounterMetricFamily,
        "spec_decode_num_accepted_tokens",
        "Speculative draft tokens kept (each the token the request sampled itself).",
        "spec_decode_num_accepted_tokens",
    ),
)


class EngineCollector(Collector):
    """Gauges and counters from the engine's latest stats snapshot."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.engine = engine
        self.model_name = model_name

    def collect(self):
        stats = self.engine.stats
        for kind, name, documentation, field in ENGINE_SERIES:
            family = kind(f"shoal:{name}", documentation, labels=["model_name"])
            family.add_metric([self.model_name], getattr(stats, field))
            yield family
        moved = CounterMetricFamily(
            "shoal:kv_transfer_blocks",
            "KV blocks sent to or taken from other workers.",
            labels=["model_name", "direction"],
        )
        moved.add_metric([self.model_name, "out"], stats.kv_blocks_exported)
        moved.add_metric([self.model_name, "in"], stats.kv_blocks_imported)
        yield moved
        if stats.kv_tier is not None:
            yield from self._tier(stats.kv_tier)

    def _tier(self, tier: TierCounters):
        """The KV tier's series, by level (shoal.engine.kv_tier)."""
        labels = ["model_name", "level"]
        hits = CounterMetricFamily("shoal:kv_tier_hits", "KV blocks found in the tier, by level.", labels=labels)
        evictions = CounterMetricFamily(
            "shoal:kv_tier_evictions", "KV blocks pushed out of a tier level, by level.", labels=labels
        )
        blocks = GaugeMetricFamily("shoal:kv_tier_blocks", "KV blocks held in the tier, by level.", labels=labels)
        for level in tier.hits:
            hits.add_metric([self.model_name, level], tier.hits[level])
            evictions.add_metric([self.model_name, level], tier.evictions[level])
            blocks.add_metric([self.model_name, level], tier.blocks[level])
        misses = CounterMetricFamily(
            "shoal:kv_tier_misses", "KV blocks looked up in the tier and found in no level.", labels=["model_name"]
        )
        misses.add_metric([self.model_name], tier.misses)
        yield from (hits, misses, evictions, blocks)


class WorkerMetrics:
    """The worker's registry; also the engine's RequestObserver (called from the engine thread,
    which prometheus-client's metric objects allow)."""

    def __init__(self, engine: AsyncLLMEngine, model_name: str):
        self.registry = CollectorRegistry()
        self.registry.register(EngineCollector(engine, model_name))
        self.registry.register(DeviceCollector(engine.engine.device))
        labels = ["model_name"]
        self.ttft = Histogram(
            "shoal:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.itl = Histogram(
            "shoal:inter_token_latency_seconds",
            "Time between consecutive tokens.",
            labels,
            buckets=ITL_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e = Histogram(
            "shoal:e2e_request_latency_seconds",
            "Arrival to finish of a request.",
            labels,
            buckets=E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.successes = Counter(
            "shoal:request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=self.registry,
        )
        self.kv_bytes = Counter(
            "shoal:kv_transfer_bytes",
            "Bytes of KV blocks sent to or taken from other workers.",
            ["model_name", "direction"],
            registry=self.registry,
        )
        self.kv_seconds = Histogram(
            "shoal:kv_transfer_seconds",
            "Time to move one request's KV blocks (fetch and import, or export and send).",
            ["model_name", "direction"],
            buckets=KV_TRANSFER_BUCKETS,
            registry=self.registry,
        )
        self.kv_import_failures = Counter(
            "shoal:kv_import_failures",
            "KV imports that failed (the KV was computed instead).",
            labels,
            registry=self.registry,
        )
        self.handoffs = Counter(
            "shoal:kv_handoffs",
            "Streams handed off to another worker, by reason (prefill, drain).",
            ["model_name", "reason"],
            registry=self.registry,
        )
        self.model_name = model_name

    def kv_moved(self, direction: str, blocks: KVBlocks, seconds: float) -> None:
        """One transfer's bytes and time (its blocks are counted by the engine)."""
        self.kv_bytes.labels(self.model_name, direction).inc(blocks.nbytes)
        self.kv_seconds.labels(self.model_name, direction).observe(seconds)

    def first_token(self, seq: Sequence, time_to_first_token_s: float) -> None:
        self.ttft.observe(time_to_first_token_s)

    def next_token(self, seq: Sequence, inter_token_latency_s: float) -> None:
        self.itl.observe(inter_token_latency_s)

    def finished(self, seq: Sequence, e2e_latency_s: float) -> None:
        self.e2e.observe(e2e_latency_s)
        self.successes.labels(self.model_name, seq.finish_reason or "unknown").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
