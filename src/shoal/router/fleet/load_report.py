"""Load reports as the router reads them: shoal's /load JSON, or the Prometheus metrics of other
OpenAI-compatible servers (vLLM, SGLang, llama.cpp's server) where they expose them."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from shoal.protocol.worker_load import LoraLoad, WorkerLoad
from shoal.router.load_figures import LoadFigures

# Per server family: (engine, running requests, waiting requests, KV usage fraction) metric names.
PROMETHEUS_NAMES = (
    ("vllm", "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
    ("vllm", "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc"),
    ("sglang", "sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
    ("llama.cpp", "llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:kv_cache_usage_ratio"),
)
NO_LORA = LoraLoad()


class LoadReport(LoadFigures, frozen=True, kw_only=True):
    """A worker's own figures, and what the router reads of its report besides: None where the
    worker does not say."""

    outstanding_prefill_tokens: int | None = None
    outstanding_decode_tokens: int | None = None
    kv_cache_usage: float | None = None
    lora_adapters: tuple[str, ...] = ()  # the LoRA adapters the worker serves, by name
    lora_loading: frozenset[str] = frozenset()  # adapters whose files it is reading
    draft_tokens: int | None = None
    accepted_draft_tokens: int | None = None
    longest_step_s: float | None = None
    draining: bool = False
    kv_peer: str | None = None
    engine: str | None = None  # the server family whose metrics were read ("vllm", "sglang", "llama.cpp")

    @classmethod
    def from_shoal(cls, report: WorkerLoad) -> LoadReport:
        block_size = report.block_size or 0
        single_rate = report.calibration.decode_tokens_per_s if report.calibration else None
        lora = report.lora or NO_LORA
        return cls(
            running=report.running,
            waiting=report.waiting,
            max_num_seqs=report.max_num_seqs,
            outstanding_prefill_tokens=report.outstanding_prefill_tokens,
            outstanding_decode_tokens=report.outstanding_decode_tokens,
            free_kv_tokens=_tokens(report.free_kv_tokens, report.free_kv_blocks, block_size),
            kv_capacity_tokens=_tokens(report.kv_capacity_tokens, report.num_kv_blocks, block_size),
            kv_cache_usage=report.kv_cache_usage,
            max_model_len=report.max_model_len,
            prefill_tokens_per_s=report.prefill_tokens_per_s,
            decode_tokens_per_s=report.decode_tokens_per_s,
            decode_step_s=report.decode_step_s,
            decode_step_noise=report.decode_step_noise,
            decode_tokens_per_step=report.decode_tokens_per_step,
            lora_adapters=tuple(lora.adapters),
            lora_held=frozenset(lora.held),
            lora_capacity=lora.capacity,
            lora_loading=frozenset(lora.loading),
            lora_load_s=lora.load_s,
            lora_on_demand=lora.on_demand,
            draft_tokens=report.draft_tokens,
            accepted_draft_tokens=report.accepted_draft_tokens,
            longest_step_s=report.longest_step_s,
            single_step_s=1.0 / single_rate if single_rate else None,
            capability=report.capability,
            unmeasured=report.generated_tokens == 0,
            draining=report.draining,
            role=report.role,
            kv_peer=report.kv_peer,
            kv_tier_tokens=report.kv_tier_tokens,
            kv_tier_load_tokens_per_s=report.kv_tier_load_tokens_per_s,
        )

    @classmethod
    def from_prometheus(cls, body: bytes | str) -> LoadReport | None:
        """Sums each known metric over its series; None if no known family is present, or if the
        body is not Prometheus text at all (a catch-all route's page, a proxy's error page)."""
        values: dict[str, float] = {}
        try:
            text = body.decode() if isinstance(body, bytes) else body
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    values[sample.name] = values.get(sample.name, 0.0) + sample.value
        except ValueError:  # UnicodeDecodeError is one
            return None
        for engine, running, waiting, usage in PROMETHEUS_NAMES:
            if running in values:
                return cls(
                    running=int(values[running]),
                    waiting=int(values.get(waiting, 0)),
                    kv_cache_usage=values.get(usage),
                    engine=engine,
                )
        return None


def _tokens(tokens: int | None, blocks: int | None, block_size: int) -> int | None:
    """A KV figure in tokens: as the worker counted it, else its blocks' tokens (None: not said)."""
    if tokens is not None:
        return tokens
    return None if blocks is None else blocks * block_size
