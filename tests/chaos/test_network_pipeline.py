"""A pipeline replica across hosts of a network test bed: the head (the worker the router sees) on
one host, its stage server on another, a spare stage server on a third. The link between the head
and its stage is cut in the middle of a stream: the head finds the stage silent, hands its layers
to the spare, rebuilds its KV cache from the boundary log, and the stream goes on token-for-token."""

from __future__ import annotations

import os
import sys
import time

import pytest
import yaml

from tests.support.routers import ADMIN_TOKEN, SECRET
from tests.support.streams import read_stream, story_request
from tests.support.waiting import answers, wait_for
from tests.support.workers import MODEL, tiny_worker_args

HOSTS = ["router", "head", "stage", "spare"]  # the network_bed fixture builds them
ROUTER_PORT, WORKER_PORT, STAGE_PORT = 8000, 8001, 7100
STEP_DEADLINE_S, PING_TIMEOUT_S = 1.0, 2.0
MAX_TOKENS = 120
# The head notices after the step deadline plus the ping timeout, then loads the spare's layers
# (already loaded: it is a warm spare) and replays; allowance for a loaded machine included.
RECOVERY_BOUND_S = STEP_DEADLINE_S + PING_TIMEOUT_S + 8.0


@pytest.fixture(scope="module")
def pipeline(network_bed, tiny_model_dir, shoal_cache_dir, tmp_path_factory):
    bed = network_bed
    logs = tmp_path_factory.mktemp("network-pipeline")
    env = {
        **os.environ,
        "SHOAL_CLUSTER_SECRET": SECRET,
        "SHOAL_ADMIN_TOKEN": ADMIN_TOKEN,
        "SHOAL_CACHE_DIR": str(shoal_cache_dir),
    }

    def start(host: str, argv: list[str]) -> None:
        with open(logs / f"{host}.log", "ab") as log:
            bed[host].popen([sys.executable, "-m", "shoal.cli", *argv], env=env, stderr=log)

    config = logs / "router.yaml"
    config.write_text(yaml.safe_dump({"host": bed["router"].address, "port": ROUTER_PORT, "state": {"store": "none"}}))
    start("router", ["router", "--config", str(config)])
    stage, spare = (f"tcp://{bed[name].address}:{STAGE_PORT}" for name in ("stage", "spare"))
    start("stage", ["stage", "--bind", stage])
    start("spare", ["stage", "--bind", spare])
    router_url = bed["router"].url(ROUTER_PORT)
    args = tiny_worker_args(tiny_model_dir, MODEL, step_delay_ms=20, kv_cache="16MiB")
    args += ["--pipeline-parallel-size", "2", "--stage-servers", stage, "--spare-stage-servers", spare]
    args += ["--pipeline-step-deadline-s", str(STEP_DEADLINE_S), "--pipeline-ping-timeout-s", str(PING_TIMEOUT_S)]
    args += ["--host", bed["head"].address, "--port", str(WORKER_PORT), "--router", router_url]
    start("head", ["worker", *args])
    head = bed["head"].url(WORKER_PORT)
    wait_for(lambda: answers(head + "/ready"), timeout_s=180)
    yield bed, router_url, logs


def story(seed: int) -> dict:
    return story_request(seed, MAX_TOKENS)


def test_a_stream_survives_the_link_between_its_head_and_a_stage_being_cut(pipeline):
    bed, router_url, logs = pipeline
    wait_for(lambda: answers(router_url + "/ready"), timeout_s=60)  # the head registered with the router
    started = time.monotonic()
    reference = read_stream(router_url, story(31))
    fault_free_s = time.monotonic() - started
    started = time.monotonic()
    faulted = read_stream(router_url, story(31), fault=lambda _: bed["stage"].cut(), after_tokens=30)
    faulted_s = time.monotonic() - started
    assert len(reference["ids"]) == MAX_TOKENS
    assert faulted["ids"] == reference["ids"] and faulted["text"] == reference["text"]
    assert faulted["usage"]["completion_tokens"] == MAX_TOKENS and len(faulted["response_ids"]) == 1
    head_log = (logs / "head.log").read_text()
    assert "pipeline stage 1 replaced: KV cache rebuilt from the boundary log" in head_log, head_log[-3000:]
    assert "takes over with its layers loaded" in head_log
    assert faulted_s - fault_free_s <= RECOVERY_BOUND_S
