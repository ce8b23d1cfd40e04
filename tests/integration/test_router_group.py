"""`shoal router --processes 3`: three real router processes on one port (SO_REUSEPORT) in front of
real tiny workers. Each request opens a new connection, so the kernel spreads them over the
members; the group still routes as one router."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.support.routers import start_router, stop
from tests.support.waiting import wait_for
from tests.support.workers import MODEL, spawn_worker, wait_ready

MEMBERS = 3


@pytest.fixture(scope="module")
def workers(tiny_model_dir, shoal_cache_dir):
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--served-model-name", MODEL, "--kv-cache", "8MiB"]
    spawned = [spawn_worker(common + ["--step-delay-ms", "10"], shoal_cache_dir) for _ in range(2)]
    started = [wait_ready(*worker) for worker in spawned]
    yield [url for _, url in started]
    for process, _ in started:
        stop(process)


@pytest.fixture
def group_for(tmp_path):
    """Factory: a router group of MEMBERS processes with these settings; returns its process and URL
    once every member has answered a request."""
    groups = []

    def make(settings: dict) -> tuple[subprocess.Popen, str]:
        config = tmp_path / f"group-{len(groups)}.yaml"
        config.write_text(yaml.safe_dump(settings))
        process, url = start_router(["--config", str(config), "--processes", str(MEMBERS)])
        groups.append(process)
        wait_for(lambda: len(members_answering(url)) == MEMBERS, timeout_s=60)
        time.sleep(1.0)  # the members' channels connect a moment after they listen
        return process, url

    yield make
    for process in groups:
        stop(process)


def members_answering(url: str, tries: int = 12) -> set[str]:
    """The members that answered `tries` requests, each on a new connection."""
    seen = set()
    for _ in range(tries):
        try:
            response = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "max_tokens": 1})
        except httpx.HTTPError:
            continue  # no member listens yet
        if response.status_code == 200:
            seen.add(response.headers["x-shoal-router"])
    return seen


def test_a_conversation_keeps_its_worker_whichever_member_routes_each_turn(workers, group_for):
    """Each conversation opens while the worker an idle router would pick is busy, so its home is
    the other one; later turns, with both idle, reach members that did not route the first: only
    the placements the members share keep them home."""
    _, url = group_for({"policy": "cache_aware", "workers": [{"url": w} for w in workers]})
    members_seen = Counter()
    for conversation in range(3):
        system = {"role": "system", "content": f"You are test model number {conversation}, with a long prompt. " * 3}
        messages = [system, {"role": "user", "content": f"conversation {conversation} opens with a question"}]
        long_request = {"model": MODEL, "prompt": f"occupy {conversation}", "max_tokens": 400, "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json={**long_request, "stream": True}, timeout=60) as busy:
            busy_worker = busy.headers["x-shoal-worker"]
            time.sleep(1.5)  # every member has heard of it (load reports, or the group's channel)
            homes = [chat_turn(url, messages, members_seen)]
        assert homes[0] != busy_worker
        time.sleep(1.5)  # both idle again, as every member sees them
        for turn in range(3):
            messages = messages + [
                {"role": "assistant", "content": f"answer {turn} " * 4},
                {"role": "user", "content": f"follow-up number {turn}"},
            ]
            homes.append(chat_turn(url, messages, members_seen))
        assert set(homes) == {homes[0]}, (conversation, homes)
    assert len(members_seen) > 1, members_seen  # the turns really crossed processes


def chat_turn(url: str, messages: list[dict], members_seen: Counter) -> str:
    """One turn on a new connection; the worker that served it."""
    response = httpx.post(
        url + "/v1/chat/completions", json={"model": MODEL, "messages": messages, "max_tokens": 4}, timeout=60
    )
    assert response.status_code == 200, response.text
    members_seen[response.headers["x-shoal-router"]] += 1
    return response.headers["x-shoal-worker"]


def test_admission_limits_hold_for_the_group_as_a_whole(workers, group_for):
    process, url = group_for(
        {
            "workers": [{"url": workers[0]}],
            "admission": {
                "max_in_flight_per_worker": 1,
                "queue_limits": {"critical": 0, "standard": 0, "sheddable": 0},
            },
        }
    )
    body = {"model": MODEL, "prompt": "hold the only slot", "max_tokens": 150, "ignore_eos": True}

    def one_request(_) -> tuple[int, str]:
        """Status and answering member; 0 when the connection died."""
        with httpx.Client(timeout=60) as client:  # its own connection: any member may get it
            try:
                response = client.post(url + "/v1/completions", json=body)
            except httpx.HTTPError:
                return 0, ""
            return response.status_code, response.headers.get("x-shoal-router", "")

    with ThreadPoolExecutor(6) as pool:
        outcomes = list(pool.map(one_request, range(6)))
    statuses = Counter(status for status, _ in outcomes)
    assert statuses == {200: 1, 429: 5}, outcomes
    assert len({member for _, member in outcomes}) > 1, outcomes

    # Members killed while one of them holds the slot: the group starts them again, slots zeroed.
    with httpx.stream("POST", url + "/v1/completions", json={**body, "max_tokens": 400, "stream": True}) as held:
        assert held.status_code == 200
        assert one_request(None)[0] == 429  # the only slot is taken, whichever member is asked
        children = subprocess.run(["pgrep", "-P", str(process.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) >= MEMBERS, children
        for pid in children:
            os.kill(int(pid), signal.SIGKILL)
        with pytest.raises(httpx.HTTPError):  # the stream died with its member
            for _ in held.iter_bytes():
                pass
    wait_for(lambda: len(members_answering(url)) == MEMBERS, timeout_s=60)
    assert one_request(None)[0] == 200


def test_any_member_scraped_counts_the_whole_groups_requests(workers, group_for):
    """Twelve requests on new connections spread over the members; every scrape, whichever member
    answers it, counts all twelve and their end-to-end latencies."""
    _, url = group_for({"policy": "round_robin", "workers": [{"url": w} for w in workers]})
    before = answered(url)
    members = {
        httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "count me", "max_tokens": 2}).headers[
            "x-shoal-router"
        ]
        for _ in range(12)
    }
    assert len(members) > 1, members

    def counted() -> tuple[float, float]:
        requests, latencies = answered(url)
        return requests - before[0], latencies - before[1]

    # A member counts a request as it finishes, just after its last byte: allow that moment.
    wait_for(lambda: counted() == (12, 12), timeout_s=10)
    for _ in range(6):  # each on a new connection: whichever member answers counts them all
        assert counted() == (12, 12)


def answered(url: str) -> tuple[float, float]:
    """From one scrape: requests answered 200, and end-to-end latencies observed."""
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(url + "/metrics").text)}
    requests = sum(
        s.value
        for s in families["shoal_router_requests"].samples
        if s.name.endswith("_total") and s.labels["status"] == "200"
    )
    latencies = sum(
        s.value for s in families["shoal_router_e2e_request_latency_seconds"].samples if s.name.endswith("_count")
    )
    return requests, latencies


def test_a_group_will_not_share_a_port_someone_else_listens_on():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "shoal.cli", "router", "--processes", "2", "--port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert result.returncode == 2 and "cannot listen" in result.stderr, result.stderr
