"""What the chaos tests share: a fleet of tiny workers on fixed ports (a killed one comes back at
the same address, logs in files), the router config they run under, and seeded requests whose
responses can be compared token for token."""

from __future__ import annotations

import os
import signal

import httpx
import yaml

from tests.support.routers import SECRET, start_router
from tests.support.streams import read_stream
from tests.support.workers import MODEL, free_port, spawn_worker, wait_ready

ADMIN = {"authorization": "Bearer test-admin-token"}
HEARTBEAT_S = 0.5
MAX_TOKENS = 100


class Fleet:
    """Workers that can be killed and started again on their port; their logs go to files. They
    hold the cluster secret, so each runs a KV peer (streams moved off a live worker carry their KV)."""

    def __init__(self, args: list[str], cache_dir, log_dir, size: int):
        self.args, self.cache_dir, self.log_dir = args, cache_dir, log_dir
        self.ports = [free_port() for _ in range(size)]
        self.processes = {}
        for started in [self._spawn(port) for port in self.ports]:
            wait_ready(*started)

    def _spawn(self, port: int):
        log_path = self.log_dir / f"worker-{port}.log"
        process, url = spawn_worker(
            self.args, self.cache_dir, port=port, stderr=open(log_path, "ab"), env={"SHOAL_CLUSTER_SECRET": SECRET}
        )
        self.processes[url] = process
        return process, url, log_path

    @property
    def urls(self) -> list[str]:
        return list(self.processes)

    def signal(self, url: str, sig: int) -> None:
        os.kill(self.processes[url].pid, sig)

    def kill(self, url: str) -> None:
        self.processes[url].kill()
        self.processes[url].wait(timeout=30)

    def restart(self, url: str) -> None:
        wait_ready(*self._spawn(int(url.rsplit(":", 1)[1])))

    def close(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.kill(process.pid, signal.SIGCONT)
                process.kill()
            process.wait(timeout=30)


def router_config(tmp_path, urls: list[str], **sections) -> str:
    config = {
        "workers": [{"url": url} for url in urls],
        "health": {"heartbeat_interval_s": HEARTBEAT_S},
        "failover": {"token_deadline_min_s": 1.0},
        **sections,
    }
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    return str(path)


def start(config: str):
    return start_router(["--config", config], env={"SHOAL_ADMIN_TOKEN": ADMIN["authorization"][7:]})


def body(seed: int, stream: bool) -> dict:
    return {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"story number {seed}"}],
        "seed": seed,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.8,
        "ignore_eos": True,
        "stream": stream,
        **({"stream_options": {"include_usage": True}} if stream else {}),
    }


def complete(url: str, seed: int, stream: bool, fault=None) -> dict:
    """One chat completion; its token ids, text and completion token count. Fails on any error.
    `fault(worker_url)` runs once 20 tokens of a stream have arrived."""
    if stream:
        result = read_stream(url, body(seed, True), fault=fault, after_tokens=20)
        return {
            "ids": result["ids"],
            "text": result["text"],
            "completion_tokens": result["usage"]["completion_tokens"],
            "id": min(result["response_ids"]),
        }
    response = httpx.post(url + "/v1/chat/completions", json=body(seed, False), timeout=120)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    return {
        "ids": choice["token_ids"],
        "text": choice["message"]["content"],
        "completion_tokens": response.json()["usage"]["completion_tokens"],
        "id": response.json()["id"],
    }


def admin(url: str) -> dict:
    return httpx.get(url + "/admin/workers", headers=ADMIN, timeout=10).json()
