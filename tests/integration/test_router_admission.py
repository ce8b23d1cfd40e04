"""Priorities, degradation, shedding, API keys and rate limits through a real router (configured
from a YAML file) in front of real, deliberately slow tiny workers."""

from __future__ import annotations

import threading

import httpx
import pytest
import yaml

from shoal.router.admission.auth import key_hash
from tests.support.routers import router_log, start_router, stop
from tests.support.waiting import wait_for
from tests.support.workers import spawn_worker, wait_ready

KEY, OTHER_KEY = "sk-test-alpha", "sk-test-beta"
ADMIN_TOKEN = "admission-admin-token"


@pytest.fixture(scope="module")
def slow_pair(tiny_model_dir, shoal_cache_dir):
    """Worker "big" and worker "small", both 30 ms per step, so requests overlap for a while."""
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--kv-cache", "8MiB", "--step-delay-ms", "30"]
    spawned = [spawn_worker(common + ["--served-model-name", name], shoal_cache_dir) for name in ("big", "small")]
    started = [wait_ready(*w) for w in spawned]
    yield {"big": started[0][1], "small": started[1][1]}
    for process, _ in started:
        process.terminate()
        process.wait(timeout=30)


@pytest.fixture
def router(slow_pair, tmp_path):
    config = {
        "policy": "cost",
        "workers": [{"url": slow_pair["big"]}, {"url": slow_pair["small"]}],
        "models": {"big": {"fallbacks": ["small"]}},
        "admission": {
            "max_in_flight_per_worker": 1,
            "queue_limits": {"critical": 2, "standard": 2, "sheddable": 1},
            "queue_timeout_s": 20,
            "degrade_max_tokens": 3,
        },
        "api_keys": [
            {"name": "alpha", "sha256": key_hash(KEY), "end_user_requests_per_minute": 1},
            {"name": "beta", "sha256": key_hash(OTHER_KEY), "requests_per_minute": 2},
        ],
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    process, url = start_router(["--config", str(path)], env={"SHOAL_ADMIN_TOKEN": ADMIN_TOKEN})
    yield url, process
    stop(process)


def post(url: str, body: dict, key: str = KEY, priority: str | None = None) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"}
    if priority:
        headers["x-shoal-priority"] = priority
    return httpx.post(url + "/v1/completions", json=body, headers=headers, timeout=60)


def long_request(model: str) -> dict:
    return {"model": model, "prompt": "hold the slot", "max_tokens": 150, "ignore_eos": True}


def routers_view(url: str) -> dict:
    """The router's admission queues (requests per priority) and its workers, by worker id."""
    view = httpx.get(url + "/admin/workers", headers={"authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=10).json()
    return {"queued": view["queued"], "workers": {w["worker_id"]: w for w in view["workers"]}}


def wait_until_placed(url: str, worker_url: str) -> None:
    """Returns once the router has sent a request to that worker and not seen it end."""
    wait_for(lambda: routers_view(url)["workers"][worker_url]["in_flight"] == 1)


def wait_until_queued(url: str, priority: str) -> None:
    wait_for(lambda: routers_view(url)["queued"][priority] == 1)


def in_background(fn, *args) -> tuple[threading.Thread, list]:
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn(*args)))
    thread.start()
    return thread, result


def test_api_keys_are_required_and_rate_limits_answer_429(router):
    url, process = router
    body = {"model": "small", "prompt": "x", "max_tokens": 1}
    assert httpx.post(url + "/v1/completions", json=body).status_code == 401
    assert post(url, body, key="sk-wrong").status_code == 401
    assert post(url, body, key=OTHER_KEY).status_code == 200
    assert post(url, body, key=OTHER_KEY).status_code == 200
    limited = post(url, body, key=OTHER_KEY)
    assert limited.status_code == 429 and int(limited.headers["retry-after"]) >= 1
    assert limited.json()["error"]["type"] == "rate_limit_error"
    assert post(url, body).status_code == 200  # another key is not limited
    # Key alpha's end users (safety_identifier, else user) have a request a minute each.
    assert post(url, {**body, "safety_identifier": "end-1"}).status_code == 200
    again = post(url, {**body, "safety_identifier": "end-1"})
    assert again.status_code == 429 and "end user end-1" in again.json()["error"]["message"]
    assert post(url, {**body, "user": "end-2"}).status_code == 200
    stop(process)
    logs = router_log(process)
    assert KEY not in logs and OTHER_KEY not in logs


def test_sheddable_degrades_to_the_fallback_then_to_a_shorter_output_then_is_shed(router, slow_pair):
    url, _ = router
    holder, _ = in_background(post, url, long_request("big"))
    wait_until_placed(url, slow_pair["big"])
    fallback = post(url, {"model": "big", "prompt": "degrade me", "max_tokens": 8}, priority="sheddable")
    assert fallback.status_code == 200 and fallback.json()["model"] == "small"
    assert fallback.headers["x-shoal-degraded"] == "fallback=small"
    small_holder, _ = in_background(post, url, long_request("small"))
    wait_until_placed(url, slow_pair["small"])
    # Both models busy: the next sheddable request is cut short and queued (the queue holds one).
    shortened, result = in_background(
        post, url, {"model": "big", "prompt": "cut me", "max_tokens": 30, "ignore_eos": True}, KEY, "sheddable"
    )
    wait_until_queued(url, "sheddable")
    # OpenAI's flex tier is the sheddable class.
    shed = post(url, {"model": "big", "prompt": "no room", "max_tokens": 30, "service_tier": "flex"})
    assert shed.status_code == 429 and shed.headers["retry-after"]
    for thread in (holder, small_holder, shortened):
        thread.join(timeout=60)
    response = result[0]
    assert response.status_code == 200 and response.headers["x-shoal-degraded"] == "max_tokens=3"
    assert response.json()["usage"]["completion_tokens"] == 3
    # Its trace shows the wait for a slot (a request admitted at once has no admission span).
    spans = httpx.get(
        f"{url}/debug/traces/{response.headers['x-shoal-trace-id']}",
        timeout=10,
        headers={"authorization": f"Bearer {ADMIN_TOKEN}"},
    ).json()["spans"]
    [root] = [s for s in spans if s["name"] == "router.request"]
    [waited] = [s for s in spans if s["name"] == "router.admission"]
    assert waited["parent_span_id"] == root["span_id"]
    assert root["attributes"]["shoal.degraded"] == "max_tokens=3"
    assert root["attributes"]["shoal.priority"] == "sheddable"


def test_critical_requests_go_ahead_of_standard_ones_and_say_their_tier(router, slow_pair):
    url, _ = router
    holder, _ = in_background(post, url, long_request("big"))
    wait_until_placed(url, slow_pair["big"])
    finished: list[str] = []

    def request(name: str, tier: str) -> None:
        body = {"model": "big", "prompt": name, "max_tokens": 10, "ignore_eos": True, "service_tier": tier}
        response = post(url, body)
        assert response.status_code == 200 and response.json()["service_tier"] == tier
        finished.append(name)

    standard, _ = in_background(request, "standard", "default")
    wait_until_queued(url, "standard")
    critical, _ = in_background(request, "critical", "priority")  # OpenAI's priority tier: the critical class
    for thread in (holder, standard, critical):
        thread.join(timeout=60)
    assert finished == ["critical", "standard"]


def test_oversized_bodies_and_headers_are_refused(router):
    url, _ = router
    body = {"model": "small", "prompt": "x" * (5 << 20)}
    assert post(url, body).status_code == 413
    huge_header = httpx.post(
        url + "/v1/completions",
        json={"model": "small", "prompt": "x"},
        headers={"authorization": f"Bearer {KEY}", "x-padding": "p" * (20 << 10)},
    )
    assert huge_header.status_code == 431 and huge_header.json()["error"]["code"] == 431

    def chunks():  # no content-length: the router counts as it reads, and stops reading
        yield b'{"model": "small", "prompt": "'
        for _ in range(6):
            yield b"x" * (1 << 20)
        yield b'"}'

    streamed = httpx.post(
        url + "/v1/completions",
        content=chunks(),
        headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"},
    )
    assert streamed.status_code == 413 and streamed.json()["error"]["type"] == "invalid_request_error"
    wrong_method = httpx.get(url + "/v1/completions", headers={"authorization": f"Bearer {KEY}"})
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    assert "use POST" in wrong_method.json()["error"]["message"]
    # A GET of /v1/chat/completions lists the key's stored chat completions (none here).
    listed = httpx.get(url + "/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"})
    assert listed.status_code == 200 and listed.json()["data"] == []


def test_bad_configs_are_refused_with_the_reason(tmp_path):
    import subprocess
    import sys

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"policy": "fastest", "admission": {"max_in_flight_per_worker": 0}}))
    result = subprocess.run(
        [sys.executable, "-m", "shoal.cli", "router", "--config", str(path)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert "unknown policy 'fastest'" in result.stderr and "max_in_flight_per_worker" in result.stderr
