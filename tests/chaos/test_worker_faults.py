"""Workers die, hang and fail under load; the router detects it, keeps every request and token, and
takes the worker back when it recovers.

Three tiny workers on fixed ports (so a killed one can come back at the same address) behind a
router with a 0.5 s heartbeat interval. Every request has a seed, so a response can be compared
token for token with the same request served without faults.
"""

from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from tests.support.fleet import (
    HEARTBEAT_S,
    MAX_TOKENS,
    admin,
    body,
    complete,
    router_config,
    start,
)
from tests.support.routers import router_log, stop
from tests.support.waiting import wait_for


def test_killing_workers_again_and_again_under_load_loses_no_request_and_no_token(fleet, tmp_path):
    router, url = start(router_config(tmp_path, fleet.urls))
    seeds = list(range(12))
    try:
        with ThreadPoolExecutor(6) as pool:
            reference = dict(zip(seeds, pool.map(lambda s: complete(url, s, stream=True), seeds)))
        assert all(len(r["ids"]) == MAX_TOKENS for r in reference.values())
        faults_done = threading.Event()
        results, kills = [], []

        def client(offset: int) -> None:
            i = offset
            while not faults_done.is_set() or i < offset + len(seeds) // 2:
                seed = seeds[i % len(seeds)]
                results.append((seed, complete(url, seed, stream=i % 3 != 0)))
                i += 1

        def chaos() -> None:
            for _ in range(3):
                wait_for(lambda: any(w["healthy"] and w["in_flight"] for w in admin(url)["workers"]), timeout_s=60)
                busiest = max(admin(url)["workers"], key=lambda w: w["in_flight"])  # kill where streams are
                victim = busiest["worker_id"]
                fleet.kill(victim)
                kills.append(victim)
                fleet.restart(victim)
            faults_done.set()

        with ThreadPoolExecutor(7) as pool:
            futures = [pool.submit(client, k * 2) for k in range(6)] + [pool.submit(chaos)]
            for future in futures:
                future.result()
        assert len(kills) == 3
        log = router_log(router)
        for seed, result in results:
            moves = [line for line in log.splitlines() if result["id"] in line]
            assert result["ids"] == reference[seed]["ids"], f"seed {seed} differs after failover: {moves}"
            assert result["text"] == reference[seed]["text"]
            assert result["completion_tokens"] == MAX_TOKENS
        downs = [e for e in admin(url)["events"] if e["change"] == "down"]
        assert {e["worker_id"] for e in downs} >= set(kills)
        migrations = log.count("migrating a stream")
        assert migrations >= 1
        print(f"{len(results)} requests, {migrations} migrations")
    finally:
        stop(router)


def test_a_stopped_worker_is_detected_within_two_heartbeats_and_rejoins_when_continued(fleet, tmp_path):
    router, url = start(router_config(tmp_path, fleet.urls))
    try:
        reference = complete(url, seed=5, stream=True)
        stopped = {}

        def stop_worker(worker: str) -> None:
            fleet.signal(worker, signal.SIGSTOP)
            stopped.update(worker=worker, at=time.time())

        resumed = complete(url, seed=5, stream=True, fault=stop_worker)
        assert (resumed["ids"], resumed["text"]) == (reference["ids"], reference["text"])
        worker = stopped["worker"]
        down = wait_for(lambda: [e for e in admin(url)["events"] if e["worker_id"] == worker and e["change"] == "down"])
        # Detected within two heartbeat intervals (plus the monitor's quarter-interval tick).
        assert down[0]["time"] - stopped["at"] <= 2 * HEARTBEAT_S + HEARTBEAT_S / 4 + 0.5
        assert not next(w for w in admin(url)["workers"] if w["worker_id"] == worker)["healthy"]
        fleet.signal(worker, signal.SIGCONT)
        wait_for(lambda: next(w for w in admin(url)["workers"] if w["worker_id"] == worker)["healthy"])
        assert [e["change"] for e in admin(url)["events"] if e["worker_id"] == worker][-1] == "up"
    finally:
        stop(router)


def test_all_workers_down_answers_503_quickly_and_a_returning_worker_serves_the_waiting_requests(fleet, tmp_path):
    config = router_config(tmp_path, fleet.urls[:1], failover={"wait_for_capacity_s": 120})
    router, url = start(config)
    worker = fleet.urls[0]
    try:
        fleet.kill(worker)
        wait_for(lambda: not admin(url)["workers"][0]["healthy"])
        # Its deadline (1 s) bounds the wait: a router ignoring it would hold the request past the
        # client's own timeout, which then fails the test.
        refused = httpx.post(
            url + "/v1/chat/completions", json=body(1, False), timeout=10, headers={"x-shoal-deadline-s": "1"}
        )
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) >= 1
        assert refused.json()["error"]["type"] == "service_unavailable"
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(complete, url, seed, False) for seed in (1, 2)]
            wait_for(lambda: admin(url)["queued"]["standard"] == 2)
            fleet.restart(worker)
            assert [len(f.result(timeout=120)["ids"]) for f in waiting] == [MAX_TOKENS, MAX_TOKENS]
    finally:
        stop(router)


def test_a_stream_waits_for_its_only_worker_to_come_back_and_goes_on_there(fleet, tmp_path):
    """A killed worker is not the request's fault: once restarted, it takes the stream again."""
    router, url = start(router_config(tmp_path, fleet.urls[:1], failover={"wait_for_capacity_s": 60}))
    try:
        reference = complete(url, 5, stream=True)

        def crash_and_restart(worker: str) -> None:
            fleet.kill(worker)
            fleet.restart(worker)

        faulty = complete(url, 5, stream=True, fault=crash_and_restart)
        assert faulty["ids"] == reference["ids"] and faulty["text"] == reference["text"]
        assert faulty["completion_tokens"] == MAX_TOKENS
        assert "migrating a stream" in router_log(router)
    finally:
        stop(router)


def test_a_streams_deadline_bounds_its_wait_for_a_worker(fleet, tmp_path):
    """Its only worker gone for good, a stream waits no longer than its x-shoal-deadline-s (a router
    ignoring it would hold the stream for the configured 120 s, past the client's own timeout)."""
    router, url = start(router_config(tmp_path, fleet.urls[:1], failover={"wait_for_capacity_s": 120}))
    try:
        killed = []
        events = []
        with httpx.stream(
            "POST", url + "/v1/chat/completions", json=body(3, True), headers={"x-shoal-deadline-s": "1"}, timeout=30
        ) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(line)
                    if len(events) == 10 and not killed:
                        fleet.kill(fleet.urls[0])
                        killed.append(True)
        assert killed and "no worker left to continue this stream" in events[-1]
    finally:
        stop(router)
