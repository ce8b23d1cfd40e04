"""Latency targets through a real router and worker: sheddable work that no worker can serve within its
TTFT target is refused at once with the reason (429), other work is served and counted as having
met or missed its targets (the goodput counter), a key's default targets apply, and a bad target
header is a 400 naming it."""

from __future__ import annotations

import httpx
import yaml

from shoal.router.admission.auth import key_hash
from tests.support.routers import start_router, stop
from tests.support.workers import MODEL, spawn_worker, tiny_worker_args, wait_ready

KEY = "sk-latency"


def outcomes(url: str) -> dict[str, float]:
    """shoal_router_target_requests_total by outcome."""
    counts: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=5).text.splitlines():
        if line.startswith("shoal_router_target_requests_total{"):
            outcome = line.split('outcome="')[1].split('"')[0]
            counts[outcome] = counts.get(outcome, 0) + float(line.rsplit(" ", 1)[1])
    return counts


def test_latency_targets_refuse_late_sheddable_work_and_count_goodput(tiny_model_dir, shoal_cache_dir, tmp_path):
    worker, url = wait_ready(*spawn_worker(tiny_worker_args(tiny_model_dir, MODEL, step_delay_ms=10), shoal_cache_dir))
    config = {
        "workers": [{"url": url}],
        "api_keys": [{"name": "patient", "sha256": key_hash(KEY), "targets": {"ttft_ms": 60000, "tpot_ms": 60000}}],
        "models": {MODEL: {"targets": {"ttft_ms": 0.001}}},  # no worker gives a first token this fast
    }
    (tmp_path / "router.yaml").write_text(yaml.safe_dump(config))
    router, router_url = start_router(["--config", str(tmp_path / "router.yaml")], env={"SHOAL_API_KEYS": "sk-plain"})
    body = {"model": MODEL, "prompt": [5, 17, 42], "max_tokens": 4, "ignore_eos": True, "stream": True}
    try:

        def post(key: str, **headers: str) -> httpx.Response:
            return httpx.post(
                router_url + "/v1/completions",
                json=body,
                headers={"authorization": f"Bearer {key}", **headers},
                timeout=60,
            )

        late = post("sk-plain", **{"x-shoal-priority": "sheddable"})  # the model's 0.001 ms target
        assert late.status_code == 429, late.text
        assert "no worker can meet this sheddable request's latency targets" in late.json()["error"]["message"]
        assert post("sk-plain").status_code == 200  # standard work is served, late
        assert post(KEY, **{"x-shoal-priority": "sheddable"}).status_code == 200  # the key's targets: a minute
        assert post("sk-plain", **{"x-shoal-ttft-target-ms": "60000"}).status_code == 200
        assert outcomes(router_url) == {"met": 2.0, "missed": 2.0}  # the refused one missed too
        bad = post("sk-plain", **{"x-shoal-ttft-target-ms": "soon"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-shoal-ttft-target-ms"
    finally:
        stop(router)
        worker.terminate()
        worker.wait(timeout=30)
