"""What the `shoal serve` tests share: its status files, the `shoal` command, a steady client load,
and the router's view of the workers."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading

import httpx
import openai


def supervised(state_dir) -> list[dict]:
    path = state_dir / "serve" / "workers.json"
    return json.loads(path.read_text()) if path.exists() else []


def shoal(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shoal.cli", *args], capture_output=True, text=True, timeout=60, **kwargs
    )


@contextlib.contextmanager
def busy(client: openai.OpenAI, clients: int, max_tokens: int):
    """Keeps `clients` threads sending completions until the block ends; yields the list of their
    completion token counts (or errors), complete once the block has ended."""
    answers, done = [], threading.Event()

    def load() -> None:
        while not done.is_set():
            try:
                answers.append(
                    client.completions.create(
                        model="tiny", prompt="x", max_tokens=max_tokens, extra_body={"ignore_eos": True}
                    ).usage.completion_tokens
                )
            except openai.OpenAIError as exc:  # recorded, so that assertions name it
                answers.append(exc)

    threads = [threading.Thread(target=load) for _ in range(clients)]
    for thread in threads:
        thread.start()
    try:
        yield answers
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=120)


def admin_workers(state_dir) -> list[dict]:
    serve = json.loads((state_dir / "serve" / "serve.json").read_text())
    return httpx.get(
        serve["url"] + "/admin/workers", timeout=10, headers={"authorization": f"Bearer {serve['admin_token']}"}
    ).json()["workers"]


def healthy_workers(state_dir) -> set[str]:
    return {w["worker_id"] for w in admin_workers(state_dir) if w["healthy"]}
