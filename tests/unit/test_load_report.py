"""Load reports from shoal's /load and from other servers' Prometheus metrics (their documented names)."""
from __future__ import annotations

from shoal.router.load_report import LoadReport

VLLM = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""
SGLANG = """# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="m"} 7.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m"} 1.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="m"} 0.5
"""
LLAMA_CPP = """# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 1
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 4
"""


def test_prometheus_reports_of_vllm_sglang_and_llama_cpp():
    assert LoadReport.from_prometheus(VLLM) == LoadReport(running=3, waiting=2, kv_cache_usage=0.25)
    assert LoadReport.from_prometheus(SGLANG) == LoadReport(running=7, waiting=1, kv_cache_usage=0.5)
    assert LoadReport.from_prometheus(LLAMA_CPP) == LoadReport(running=1, waiting=4)
    assert LoadReport.from_prometheus("# TYPE other_metric gauge\nother_metric 1\n") is None


def test_shoal_report_converts_blocks_to_tokens():
    report = LoadReport.from_shoal({"running": 2, "waiting": 1, "max_num_seqs": 64, "free_kv_blocks": 10,
                                    "num_kv_blocks": 40, "block_size": 16, "outstanding_decode_tokens": 90,
                                    "capability": 200.0, "draining": True})
    assert report.free_kv_tokens == 160 and report.kv_capacity_tokens == 640 and report.max_num_seqs == 64
    assert report.outstanding_decode_tokens == 90 and report.capability == 200.0 and report.draining
