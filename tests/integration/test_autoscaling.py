"""Autoscaling under `shoal serve` with a tiny model: a load ramp adds a replica after the upscale
delay, quiet removes it again (drained), a model scales to zero and back for a waiting request,
and no request fails on the way."""

from __future__ import annotations

import time

import openai

from tests.support.serving import busy, supervised
from tests.support.waiting import wait_for

RAMP = {
    "min_replicas": 1,
    "max_replicas": 2,
    "target_queued_per_replica": None,
    "target_kv_cache_usage": None,
    "target_outstanding_tokens_per_replica": 300,
    "upscale_delay_s": 1,
    "downscale_delay_s": 3,
}


def serving(state_dir) -> list[dict]:
    return [s for s in supervised(state_dir) if s["state"] == "serving"]


def test_a_load_ramp_scales_up_after_the_delay_and_quiet_scales_down_without_failing_a_request(deploy):
    _, url, state_dir, _ = deploy(replicas=1, step_delay_ms=20, autoscaling=RAMP)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    ramp = time.monotonic()
    with busy(client, clients=6, max_tokens=120) as answers:
        wait_for(lambda: len(supervised(state_dir)) == 2, timeout_s=30)
        scaled_up_after = time.monotonic() - ramp
        wait_for(lambda: len(serving(state_dir)) == 2, timeout_s=120)
    # 1 s of pressure, plus the time to see it (load reports every 0.5 s, decisions every 0.5 s).
    assert scaled_up_after < 1 + 5
    two = {s["pid"] for s in serving(state_dir)}
    wait_for(lambda: len(supervised(state_dir)) == 1, timeout_s=60)
    assert answers and set(answers) == {120}, [a for a in answers if a != 120][:3]
    assert (
        client.completions.create(
            model="tiny", prompt="x", max_tokens=4, extra_body={"ignore_eos": True}
        ).usage.completion_tokens
        == 4
    )
    assert len({s["pid"] for s in serving(state_dir)} & two) == 1


def test_a_model_scales_to_zero_when_idle_and_a_request_brings_it_back(deploy):
    idle = {**RAMP, "min_replicas": 0, "downscale_delay_s": 2}
    # The first request waits for the cold start: allow it more than a loaded machine may need.
    _, url, state_dir, _ = deploy(replicas=1, autoscaling=idle, router={"failover": {"wait_for_capacity_s": 60}})
    wait_for(lambda: not supervised(state_dir), timeout_s=60)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    cold = client.completions.create(
        model="tiny", prompt="x", max_tokens=4, extra_body={"ignore_eos": True}
    )  # waits for a cold start
    assert cold.usage.completion_tokens == 4 and len(serving(state_dir)) == 1
