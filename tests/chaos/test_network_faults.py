"""Network faults between hosts: a router, two workers and Redis, each in a network namespace of a
test bed (tests/support/testbed.py), the client on the machine itself. A stream whose worker's link
is cut, blackholed, blocked one way or slowed goes on token-for-token; Redis out of reach makes the
Responses API answer 503 while chat completions go on, and nothing stored is lost. Each test bounds
the time the router takes to act on the fault."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import openai
import pytest
import yaml

from tests.support.redis_server import start_redis_server
from tests.support.routers import ADMIN_TOKEN, SECRET
from tests.support.streams import read_stream, story_request
from tests.support.testbed import Host, NetworkBed
from tests.support.waiting import answers, wait_for
from tests.support.workers import MODEL, tiny_worker_args

HOSTS = ["router", "w1", "w2", "redis"]  # the network_bed fixture builds them
ROUTER_PORT, WORKER_PORT = 8000, 8001
HEARTBEAT_S = 0.5
TOKEN_DEADLINE_S = 1.0
MAX_TOKENS = 150
ADMIN = {"authorization": f"Bearer {ADMIN_TOKEN}"}
# What the router needs to act on a fault: the token deadline or two silent heartbeats, whichever
# comes first, plus the connect timeout of a retry; allowance for a loaded machine included.
DETECTION_BOUND_S = 6.0


@dataclass
class Cluster:
    bed: NetworkBed
    router_url: str
    workers: dict[str, Host]  # worker URL -> its host
    redis_url: str

    def events(self, since: float) -> list[dict]:
        body = httpx.get(self.router_url + "/admin/workers", headers=ADMIN, timeout=10).json()
        return [e for e in body["events"] if e["time"] >= since]

    def healthy(self) -> set[str]:
        body = httpx.get(self.router_url + "/admin/workers", headers=ADMIN, timeout=10).json()
        return {w["worker_id"] for w in body["workers"] if w["healthy"]}


@pytest.fixture(scope="module")
def cluster(network_bed, tiny_model_dir, shoal_cache_dir, tmp_path_factory):
    bed = network_bed
    logs = tmp_path_factory.mktemp("network-faults")
    _, redis_url = start_redis_server(logs, host=bed["redis"])
    router_host = bed["router"]
    config = logs / "router.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "host": router_host.address,
                "port": ROUTER_PORT,
                "health": {"heartbeat_interval_s": HEARTBEAT_S},
                "failover": {"token_deadline_min_s": TOKEN_DEADLINE_S},
                "state": {"store": "redis", "redis_url": redis_url},
            }
        )
    )
    env = {**os.environ, "SHOAL_CLUSTER_SECRET": SECRET, "SHOAL_ADMIN_TOKEN": ADMIN_TOKEN}
    with open(logs / "router.log", "ab") as log:
        router_host.popen([sys.executable, "-m", "shoal.cli", "router", "--config", str(config)], env=env, stderr=log)
    router_url = router_host.url(ROUTER_PORT)
    workers = {}
    for name in ("w1", "w2"):
        host = bed[name]
        args = tiny_worker_args(tiny_model_dir, MODEL, step_delay_ms=20)
        args += ["--host", host.address, "--port", str(WORKER_PORT), "--router", router_url]
        with open(logs / f"{name}.log", "ab") as log:
            host.popen(
                [sys.executable, "-m", "shoal.cli", "worker", *args],
                env={**env, "SHOAL_CACHE_DIR": str(shoal_cache_dir)},
                stderr=log,
            )
        workers[host.url(WORKER_PORT)] = host
    running = Cluster(bed, router_url, workers, redis_url)
    wait_for(lambda: answers(running.router_url + "/health") and running.healthy() == set(workers), timeout_s=180)
    yield running


@pytest.fixture
def network(cluster):
    """The cluster, healed and with both workers healthy again after the test."""
    yield cluster
    for host in cluster.bed.hosts.values():
        host.heal()
    wait_for(lambda: cluster.healthy() == set(cluster.workers), timeout_s=60)


def story(seed: int) -> dict:
    return story_request(seed, MAX_TOKENS)


def stream_through(network: Cluster, seed: int, fault: Callable[[Host], None]) -> tuple[dict, dict, dict]:
    """The seeded story streamed fault-free, then again with `fault` applied to the host of the worker
    serving it 30 tokens in; returns (reference, faulted, {"host", "at"} of the fault)."""
    reference = read_stream(network.router_url, story(seed))
    applied = {}

    def inject(worker: str) -> None:
        host = network.workers[worker]
        applied.update(host=host, worker=worker, at=time.time())
        fault(host)

    faulted = read_stream(network.router_url, story(seed), fault=inject, after_tokens=30)
    return reference, faulted, applied


def assert_identical(reference: dict, faulted: dict) -> None:
    assert len(reference["ids"]) == MAX_TOKENS
    assert faulted["ids"] == reference["ids"] and faulted["text"] == reference["text"]
    assert faulted["usage"]["completion_tokens"] == MAX_TOKENS and len(faulted["response_ids"]) == 1


def first_event(network: Cluster, worker: str, since: float, changes: tuple[str, ...]) -> dict:
    return wait_for(
        lambda: next((e for e in network.events(since) if e["worker_id"] == worker and e["change"] in changes), None),
        timeout_s=30,
    )


def migrated_after(network: Cluster, stream: dict, since: float) -> float:
    """Seconds from `since` (wall clock) to the stream's one migration, from its trace."""
    spans = httpx.get(f"{network.router_url}/debug/traces/{stream['trace_id']}", headers=ADMIN, timeout=10).json()
    [root] = [s for s in spans["spans"] if s["name"] == "router.request"]
    [migration] = [e for e in root["events"] if e["name"] == "migration"]
    return migration["time_ns"] / 1e9 - since


def test_every_component_binds_and_advertises_its_own_hosts_address(network):
    bed = network.bed
    assert bed["router"].listening() == [f"{bed['router'].address}:{ROUTER_PORT}"]
    assert bed["redis"].listening() == [f"{bed['redis'].address}:6379"]
    for url, host in network.workers.items():
        kv_peer = httpx.get(url + "/load", timeout=10).json()["kv_peer"]  # tcp://ADDRESS:PORT
        assert kv_peer.startswith(f"tcp://{host.address}:"), kv_peer
        assert host.listening() == sorted([f"{host.address}:{WORKER_PORT}", kv_peer.removeprefix("tcp://")]), url
    body = httpx.get(network.router_url + "/admin/workers", headers=ADMIN, timeout=10).json()
    assert {w["worker_id"] for w in body["workers"]} == {f"http://{bed[n].address}:{WORKER_PORT}" for n in ("w1", "w2")}


@pytest.mark.parametrize("fault", ["cut", "blackhole"])
def test_a_stream_survives_its_workers_link_going_dark(network, fault):
    """A cut link and a blackhole look the same to TCP: no FIN, no RST, silence. The router calls the
    worker down once its heartbeats stop; the stream has already moved on its token deadline."""
    reference, faulted, applied = stream_through(network, 11, lambda host: getattr(host, fault)())
    assert_identical(reference, faulted)
    down = first_event(network, applied["worker"], applied["at"], ("down",))
    assert down["time"] - applied["at"] <= DETECTION_BOUND_S, down
    assert applied["worker"] not in network.healthy()


def test_a_one_way_partition_moves_the_stream_and_the_requests_after_it(network):
    """The router's packets to the worker's port are dropped while the worker's heartbeats to the
    router still arrive: the worker looks alive, but the stream stalls. The token deadline moves the
    stream; new requests that try the worker time out connecting and go to the other one."""
    reference, faulted, applied = stream_through(
        network, 12, lambda host: host.block(WORKER_PORT, network.bed["router"])
    )
    assert_identical(reference, faulted)
    assert migrated_after(network, faulted, applied["at"]) <= DETECTION_BOUND_S
    assert applied["worker"] in network.healthy()  # its heartbeats still arrive
    client = openai.OpenAI(base_url=network.router_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for i in range(4):
        answer = client.completions.create(
            model=MODEL, prompt=f"after the partition {i}", max_tokens=8, extra_body={"ignore_eos": True}
        )
        assert answer.usage.completion_tokens == 8


def test_a_slow_link_slows_the_stream_but_loses_nothing(network):
    """At 48 kbit/s the worker's heartbeats and tokens arrive late: the router calls it down or moves
    its stream on the token deadline; either way the stream stalls no longer than the bound."""
    reference, faulted, applied = stream_through(network, 13, lambda host: host.slow("48kbit"))
    assert_identical(reference, faulted)
    assert faulted["longest_gap_s"] <= DETECTION_BOUND_S


def test_with_redis_out_of_reach_responses_answer_503_chat_goes_on_and_nothing_stored_is_lost(network):
    client = openai.OpenAI(base_url=network.router_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    stored = client.responses.create(model=MODEL, input="remember me", max_output_tokens=8)
    network.bed["redis"].cut()
    cut_at = time.monotonic()
    with pytest.raises(openai.APIStatusError) as refused:
        client.responses.create(model=MODEL, input="and me", max_output_tokens=8, previous_response_id=stored.id)
    assert refused.value.status_code == 503 and "Redis" in refused.value.message
    assert time.monotonic() - cut_at <= DETECTION_BOUND_S + 5  # the store's socket timeout is 5 s
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, extra_body={"ignore_eos": True}
    )
    assert chat.usage.completion_tokens == 8
    network.bed["redis"].heal()
    follow_up = wait_for(lambda: _continues(client, stored.id), timeout_s=30)
    assert follow_up.previous_response_id == stored.id and follow_up.usage.input_tokens > stored.usage.input_tokens
    assert client.responses.retrieve(stored.id).output_text == stored.output_text


def _continues(client: openai.OpenAI, previous: str):
    try:
        return client.responses.create(model=MODEL, input="and me", max_output_tokens=8, previous_response_id=previous)
    except openai.APIStatusError as exc:
        if exc.status_code == 503:
            return None
        raise
