"""Load reports from shoal's /load and from other servers' Prometheus metrics (their documented names)."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry

from shoal.protocol.worker_load import (
    Heartbeat,
    Registration,
    RegistrationAccepted,
    WorkerLoad,
    decode_heartbeat,
    decode_load,
    decode_registration,
    decode_registration_accepted,
    encode,
)
from shoal.router.config import HealthSettings
from shoal.router.fleet.health_events import HealthEvents
from shoal.router.fleet.load_report import LoadReport
from shoal.router.fleet.membership import Membership
from shoal.router.load_figures import FIGURE_NAMES, figures_of

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
    assert LoadReport.from_prometheus(VLLM) == LoadReport(running=3, waiting=2, kv_cache_usage=0.25, engine="vllm")
    assert LoadReport.from_prometheus(SGLANG) == LoadReport(running=7, waiting=1, kv_cache_usage=0.5, engine="sglang")
    assert LoadReport.from_prometheus(LLAMA_CPP) == LoadReport(running=1, waiting=4, engine="llama.cpp")
    assert LoadReport.from_prometheus("# TYPE other_metric gauge\nother_metric 1\n") is None


@pytest.mark.parametrize(
    "body", [b"<html><body>Not found</body></html>", b'{"detail": "Not Found"}', b"\xff\xfe binary", b"hello world"]
)
def test_a_body_that_is_not_prometheus_text_is_no_report(body):
    assert LoadReport.from_prometheus(body) is None


def test_a_server_answering_every_path_with_a_page_is_a_worker_without_metrics(caplog):
    """A catch-all route (or a proxy's page) at /load, /metrics and /health: the poll is contact,
    the worker has no report (placed by the router's in-flight requests) and is not marked down;
    said once in the log, not at every poll."""
    membership = Membership(HealthSettings(), HealthEvents(CollectorRegistry()))
    asked = []

    async def page(url: str) -> tuple[int, bytes]:
        asked.append(url.removeprefix("http://catch-all"))
        return 200, b"<!doctype html><title>Welcome</title>"

    membership._get = page
    state = membership._new_state("http://catch-all", frozenset({"m"}), registered=False)
    state.last_seen -= 10
    with caplog.at_level(logging.INFO, logger="shoal.router.fleet.membership"):
        for _ in range(2):
            asyncio.run(membership.poll(state))
    assert asked == ["/load", "/metrics", "/health"] * 2
    assert state.load_source == "router" and state.report is None
    assert time.monotonic() - state.last_seen < 5
    assert sum("reports no load the router reads" in r.getMessage() for r in caplog.records) == 1


def test_shoal_report_converts_blocks_to_tokens():
    report = LoadReport.from_shoal(
        decode_load(
            b'{"running": 2, "waiting": 1, "max_num_seqs": 64, "free_kv_blocks": 10,'
            b' "num_kv_blocks": 40, "block_size": 16, "outstanding_decode_tokens": 90,'
            b' "capability": 200.0, "draining": true, "decode_step_noise": 0.15, "a_newer_figure": 1}'
        )
    )
    assert report.free_kv_tokens == 160 and report.kv_capacity_tokens == 640 and report.max_num_seqs == 64
    assert report.decode_step_noise == 0.15
    assert report.outstanding_decode_tokens == 90 and report.capability == 200.0 and report.draining
    assert not report.unmeasured  # a worker that does not say is not taken for a new one


def test_a_worker_that_has_generated_nothing_yet_is_unmeasured():
    fresh = LoadReport.from_shoal(decode_load(b'{"running": 0, "waiting": 0, "generated_tokens": 0}'))
    served = LoadReport.from_shoal(decode_load(b'{"running": 0, "waiting": 0, "generated_tokens": 12}'))
    assert fresh.unmeasured and not served.unmeasured


def test_every_figure_of_a_report_reaches_the_view_policies_read():
    """The figures are declared once (LoadFigures): a report whose every figure differs from its
    default gives a view showing each of them, beside the router's own accounting."""
    values = {
        "running": 3,
        "waiting": 2,
        "role": "decode",
        "unmeasured": True,
        "lora_on_demand": True,
        "lora_held": frozenset({"adapter"}),
    }
    for position, name in enumerate(FIGURE_NAMES):
        values.setdefault(name, position + 7 if name.endswith(("tokens", "seqs", "len", "capacity")) else position / 8)
    report = LoadReport(**values, outstanding_prefill_tokens=40, engine="shoal")
    membership = Membership(HealthSettings(), HealthEvents(CollectorRegistry()))
    state = membership._new_state("http://a", frozenset({"m"}), registered=False)
    state.report = report
    view = state.view()
    assert figures_of(view) == figures_of(report) == values
    assert view.outstanding_prefill_tokens == 40 and view.worker_id == "http://a"


def test_worker_messages_round_trip_through_the_one_schema():
    load = WorkerLoad(
        model="m",
        running=1,
        waiting=0,
        free_kv_blocks=3,
        num_kv_blocks=4,
        block_size=16,
        kv_cache_budget_bytes=1 << 20,
        kv_cache_usage=0.25,
    )
    assert decode_load(encode(load)) == load
    joining = Registration(url="http://w:1", models=["m"], load=load)
    assert decode_registration(encode(joining)) == joining
    assert decode_heartbeat(encode(Heartbeat(worker_id="http://w:1"))) == Heartbeat(worker_id="http://w:1")
    accepted = RegistrationAccepted(worker_id="http://w:1", lease_s=3.0, heartbeat_interval_s=1.0)
    assert decode_registration_accepted(encode(accepted)) == accepted


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"running": -1}', "running"),
        (b'{"kv_cache_usage": 1.5}', "kv_cache_usage"),
        (b'{"free_kv_blocks": "many"}', "free_kv_blocks"),
        (b"[1, 2]", "object"),
        (b'{"running": 1', "truncated|JSON"),
    ],
)
def test_a_load_report_that_does_not_fit_the_schema_is_refused_naming_why(body, reason):
    with pytest.raises(ValueError, match=reason):
        decode_load(body)


@pytest.mark.parametrize(
    "body", [b'{"models": ["m"]}', b'{"url": "", "models": ["m"]}', b'{"url": "http://w:1", "models": "m"}']
)
def test_a_registration_without_a_url_or_a_list_of_models_is_refused(body):
    with pytest.raises(ValueError):
        decode_registration(body)


def test_another_server_s_load_answer_is_not_taken_for_a_shoal_report():
    from shoal.protocol.worker_load import WorkerLoad, encode
    from shoal.router.fleet.membership import shoal_load_report

    assert shoal_load_report(b'{"server_load": 0}') is None  # vLLM's /load
    assert shoal_load_report(b'{"running": "many"}') is None
    assert shoal_load_report(b"not json") is None
    assert shoal_load_report(encode(WorkerLoad(server="shoal", running=3))).running == 3
