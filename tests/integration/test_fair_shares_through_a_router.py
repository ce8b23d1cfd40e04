"""Fair shares between tenants through a real router: one slot on one slow worker, a tenant that sends
six times as many requests as each other tenant has all of them queued first, and still each
backlogged tenant gets its share of what is served while all of them wait (the order requests are
answered in, not timing)."""

from __future__ import annotations

import threading
import time

import httpx
import yaml

from shoal.router.admission.auth import key_hash
from tests.support.routers import start_router, stop
from tests.support.waiting import wait_for
from tests.support.workers import MODEL, spawn_worker, tiny_worker_args, wait_ready

KEYS = {"heavy": "sk-heavy", "a": "sk-tenant-a", "b": "sk-tenant-b"}


def test_a_tenant_sending_ten_times_the_others_gets_its_share(tiny_model_dir, shoal_cache_dir, tmp_path):
    worker, url = wait_ready(*spawn_worker(tiny_worker_args(tiny_model_dir, MODEL, step_delay_ms=20), shoal_cache_dir))
    config = {
        "workers": [{"url": url}],
        "admission": {"max_in_flight_per_worker": 1, "queue_timeout_s": 120},
        "api_keys": [{"name": name, "sha256": key_hash(key)} for name, key in KEYS.items()],
    }
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    router, router_url = start_router(["--config", str(tmp_path / "router.yaml")])
    answered: list[str] = []
    lock = threading.Lock()

    def send(tenant: str) -> None:
        body = {"model": MODEL, "prompt": [5, 17, 42], "max_tokens": 4, "ignore_eos": True}
        headers = {"authorization": f"Bearer {KEYS[tenant]}"}
        response = httpx.post(router_url + "/v1/completions", json=body, headers=headers, timeout=180)
        assert response.status_code == 200, response.text
        with lock:
            answered.append(tenant)

    try:
        threads = [threading.Thread(target=send, args=("heavy",)) for _ in range(24)]
        for thread in threads:
            thread.start()
        wait_for(lambda: _queued(router_url) >= 18, 30)  # heavy's requests wait for the one slot
        started = len(answered)
        others = [threading.Thread(target=send, args=(tenant,)) for tenant in ("a", "b") for _ in range(4)]
        for thread in others:
            thread.start()
            time.sleep(0.05)
        for thread in threads + others:
            thread.join(timeout=240)
        # While all three were backlogged (a and b until their last request): a third each.
        window = answered[started + 2 : started + 14]  # past the requests already admitted or answering
        assert window.count("a") >= 3 and window.count("b") >= 3, answered
    finally:
        stop(router)
        worker.terminate()
        worker.wait(timeout=30)


def _queued(url: str) -> int:
    """Requests waiting for admission at the router (its shoal_router_queued_requests gauge)."""
    metrics = httpx.get(url + "/metrics", timeout=5).text
    return int(
        sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("shoal_router_queued_requests{")
        )
    )
