"""A worker that is alive but slow (a gray failure): the router sees its inter-token latency far
above the fleet's, ejects it, moves its streams without losing a token, and takes it back when the
ejection ends.

The slowness is real: the worker process is stopped and continued in a 6-in-7 duty cycle, so it
answers everything, only several times slower (far enough past the 3x rule to stand out on a busy
machine where every worker is slowed by the others). It still answers its KV peer, so the streams
moved off it carry their KV instead of recomputing it."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tests.support.fleet import admin, complete, router_config, start
from tests.support.routers import stop
from tests.support.waiting import wait_for
from tests.support.workers import scrape


def slow_down(pid: int, until: threading.Event) -> None:
    while not until.is_set():
        os.kill(pid, signal.SIGSTOP)
        time.sleep(0.06)
        os.kill(pid, signal.SIGCONT)
        time.sleep(0.01)


def test_a_slow_worker_is_ejected_its_streams_move_on_intact_and_it_rejoins(fleet, tmp_path):
    # Round robin keeps sending the slow worker its share (the cost policy would starve it, and a
    # worker that gets no requests shows no latency).
    config = router_config(
        tmp_path,
        fleet.urls,
        policy="round_robin",
        health={"heartbeat_interval_s": 0.5, "outliers": {"min_samples": 10, "ejection_s": 3.0}},
    )
    router, url = start(config)
    seeds = list(range(6))
    try:
        with ThreadPoolExecutor(6) as pool:
            reference = dict(zip(seeds, pool.map(lambda s: complete(url, s, stream=True), seeds)))
        slow = fleet.urls[2]
        healed = threading.Event()
        slowing = threading.Thread(target=slow_down, args=(fleet.processes[slow].pid, healed))
        slowing.start()
        try:
            ejected = []
            deadline = time.monotonic() + 90
            while not ejected and time.monotonic() < deadline:
                with ThreadPoolExecutor(6) as pool:
                    results = list(pool.map(lambda s: (s, complete(url, s, stream=True)), seeds))
                for seed, result in results:
                    assert result["ids"] == reference[seed]["ids"], f"seed {seed} differs"
                ejected = [e for e in admin(url)["events"] if e["change"] == "ejected"]
        finally:
            healed.set()
            slowing.join()
            os.kill(fleet.processes[slow].pid, signal.SIGCONT)
        assert [e["worker_id"] for e in ejected] == [slow]
        assert "latency" in ejected[0]["reason"]
        # the streams cut at the ejection moved with their KV, fetched from the slow worker
        assert sum(v for k, v in scrape(url).items() if k.startswith("shoal_router_migrations_total")) > 0
        imported = sum(
            scrape(w).get("shoal:kv_transfer_bytes_total[('direction', 'in')]", 0) for w in fleet.urls if w != slow
        )
        assert imported > 0
        wait_for(lambda: [e for e in admin(url)["events"] if e["change"] == "rejoined"], timeout_s=30)
        assert next(w for w in admin(url)["workers"] if w["worker_id"] == slow)["healthy"]
    finally:
        stop(router)
