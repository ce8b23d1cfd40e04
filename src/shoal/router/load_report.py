"""Load reports as the router reads them: shoal's /load JSON, or the Prometheus metrics of other
OpenAI-compatible servers (vLLM, SGLang, llama.cpp's server) where they expose them."""
from __future__ import annotations

from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

# Per server family: (running requests, waiting requests, KV usage fraction) metric names.
PROMETHEUS_NAMES = (
    ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"),
    ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:gpu_cache_usage_perc"),
    ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage"),
    ("llamacpp:requests_processing", "llamacpp:requests_deferred", "llamacpp:kv_cache_usage_ratio"),
)


@dataclass(frozen=True)
class LoadReport:
    """A worker's own figures; None where the worker does not say."""

    running: int = 0
    waiting: int = 0
    max_num_seqs: int | None = None
    outstanding_prefill_tokens: int | None = None
    outstanding_decode_tokens: int | None = None
    free_kv_tokens: int | None = None
    kv_capacity_tokens: int | None = None
    kv_cache_usage: float | None = None
    max_model_len: int | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    decode_step_s: float | None = None
    single_step_s: float | None = None
    capability: float | None = None
    draining: bool = False

    @classmethod
    def from_shoal(cls, report: dict) -> "LoadReport":
        block_size = int(report.get("block_size") or 0)
        single_rate = (report.get("calibration") or {}).get("decode_tokens_per_s")
        return cls(
            running=int(report.get("running", 0)), waiting=int(report.get("waiting", 0)),
            max_num_seqs=report.get("max_num_seqs"), outstanding_prefill_tokens=report.get("outstanding_prefill_tokens"),
            outstanding_decode_tokens=report.get("outstanding_decode_tokens"),
            free_kv_tokens=int(report["free_kv_blocks"]) * block_size if "free_kv_blocks" in report else None,
            kv_capacity_tokens=int(report["num_kv_blocks"]) * block_size if "num_kv_blocks" in report else None,
            kv_cache_usage=report.get("kv_cache_usage"), max_model_len=report.get("max_model_len"),
            prefill_tokens_per_s=report.get("prefill_tokens_per_s"),
            decode_tokens_per_s=report.get("decode_tokens_per_s"), decode_step_s=report.get("decode_step_s"),
            single_step_s=1.0 / single_rate if single_rate else None, capability=report.get("capability"), draining=bool(report.get("draining", False)))

    @classmethod
    def from_prometheus(cls, text: str) -> "LoadReport | None":
        """Sums each known metric over its series; None if no known family is present."""
        values: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                values[sample.name] = values.get(sample.name, 0.0) + sample.value
        for running, waiting, usage in PROMETHEUS_NAMES:
            if running in values:
                return cls(running=int(values[running]), waiting=int(values.get(waiting, 0)),
                           kv_cache_usage=values.get(usage))
        return None
