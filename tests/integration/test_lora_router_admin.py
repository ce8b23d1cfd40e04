"""An operator loads and unloads LoRA adapters through a real router (admin token), for one worker
or the whole fleet: the router passes the change on with the cluster secret (which the workers ask
for), and routes requests for an adapter to the workers whose load reports name it."""

from __future__ import annotations

import httpx
import pytest
import yaml

from tests.support.lora_adapters import write_adapter
from tests.support.routers import SECRET, start_router, stop
from tests.support.waiting import wait_for
from tests.support.workers import MODEL, spawn_worker, tiny_worker_args, wait_ready

ADMIN = {"authorization": "Bearer lora-admin"}


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, shoal_cache_dir, tmp_path_factory):
    """(router url, [worker urls]): two workers with LoRA on and a lora_dir holding adapter a1."""
    root = tmp_path_factory.mktemp("lora-dir")
    write_adapter(tiny_model_dir, root / "a1", rank=4)
    args = tiny_worker_args(tiny_model_dir, MODEL, "--enable-lora", "--max-loras", "2", "--lora-dir", str(root))
    workers = [wait_ready(*spawn_worker(args, shoal_cache_dir, env={"SHOAL_CLUSTER_SECRET": SECRET})) for _ in range(2)]
    config = tmp_path_factory.mktemp("router") / "router.yaml"
    config.write_text(
        yaml.safe_dump({"workers": [{"url": url} for _, url in workers], "health": {"heartbeat_interval_s": 0.5}})
    )
    router, url = start_router(["--config", str(config)], env={"SHOAL_ADMIN_TOKEN": "lora-admin"})
    yield url, [worker_url for _, worker_url in workers]
    stop(router)
    for process, _ in workers:
        process.kill()
        process.wait(timeout=30)


def served_by(url: str, model: str) -> set[str]:
    return {
        w["worker_id"]
        for w in httpx.get(url + "/admin/workers", headers=ADMIN).json()["workers"]
        if model in w["models"]
    }


def complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": [5, 17, 42], "max_tokens": 3, "temperature": 0}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_adapters_are_loaded_for_one_worker_or_the_fleet_and_requests_follow(fleet):
    url, workers = fleet
    change = {"lora_name": "a1", "lora_path": "a1"}
    assert httpx.post(url + "/v1/load_lora_adapter", json=change).status_code == 401
    first = httpx.post(url + "/v1/load_lora_adapter", json={**change, "worker": workers[0]}, headers=ADMIN, timeout=60)
    assert first.status_code == 200, first.text
    assert set(first.json()["workers"]) == {workers[0]}
    wait_for(lambda: served_by(url, "a1") == {workers[0]}, 30)
    for _ in range(4):
        answer = complete(url, "a1")
        assert answer.status_code == 200 and answer.headers["x-shoal-worker"] == workers[0]
    rest = httpx.post(url + "/v1/load_lora_adapter", json={**change, "worker": workers[1]}, headers=ADMIN, timeout=60)
    assert rest.status_code == 200, rest.text
    wait_for(lambda: served_by(url, "a1") == set(workers), 30)
    gone = httpx.post(url + "/v1/unload_lora_adapter", json={"lora_name": "a1"}, headers=ADMIN, timeout=60)
    assert gone.status_code == 200 and set(gone.json()["workers"]) == set(workers)
    wait_for(lambda: not served_by(url, "a1"), 30)
    assert complete(url, "a1").status_code == 404


def test_a_worker_refuses_a_change_without_the_cluster_secret_and_the_router_says_which(fleet):
    url, workers = fleet
    direct = httpx.post(workers[0] + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "a1"}, timeout=60)
    assert direct.status_code == 401
    bad = httpx.post(
        url + "/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/etc"}, headers=ADMIN, timeout=60
    )
    assert bad.status_code == 400
    assert all(
        "outside this worker's lora_dir" in r["answer"]["error"]["message"] for r in bad.json()["workers"].values()
    )
