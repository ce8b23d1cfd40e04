"""`shoal serve` from its first second: a request sent while the workers still start waits for them
and succeeds; the router's /ready says which models serve; a prompt longer than every worker's
context window is the client's error (400, context_length_exceeded), streamed or not, never a 503
that OpenAI clients would retry."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import openai
import pytest
import yaml

from tests.support.serving import supervised
from tests.support.waiting import wait_for
from tests.support.workers import free_port


@pytest.fixture
def starting(tiny_model_dir, shoal_cache_dir, tmp_path):
    """`shoal serve` of two tiny replicas, returned as soon as it listens (before its workers)."""
    port = free_port()
    config = tmp_path / "shoal.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "port": port,
                "state_dir": str(tmp_path / "state"),
                "models": [
                    {
                        "name": "tiny",
                        "model": str(tiny_model_dir),
                        "replicas": 2,
                        "dtype": "float32",
                        "kv_cache": "8MiB",
                        "drain_grace_s": 2,
                    }
                ],
                "router": {"admission": {"queue_timeout_s": 300}},
            }
        )
    )
    output = tmp_path / "serve.out"
    with open(output, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "shoal.cli", "serve", "--config", str(config)],
            env={**os.environ, "SHOAL_CACHE_DIR": str(shoal_cache_dir)},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    wait_for(lambda: _answers(url + "/health"), timeout_s=60)
    yield url, output
    process.kill()
    process.wait(timeout=30)
    for slot in supervised(tmp_path / "state"):
        if slot["pid"]:
            try:
                os.kill(slot["pid"], 9)
            except ProcessLookupError:
                pass


def _answers(url: str) -> bool:
    try:
        return httpx.get(url, timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_a_chat_sent_at_start_waits_for_the_workers_and_ready_follows_them(starting):
    url, output = starting
    early = httpx.get(url + "/ready", timeout=5)
    assert "ready:" not in output.read_text()
    assert early.status_code == 503 and early.json() == {"ready": False, "models": {"tiny": 0}}
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    answer = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4, extra_body={"ignore_eos": True}
    )
    assert answer.usage.completion_tokens == 4
    wait_for(lambda: "ready: 2 workers serving" in output.read_text(), timeout_s=180)
    ready = httpx.get(url + "/ready", timeout=5)
    assert ready.status_code == 200 and ready.json() == {"ready": True, "models": {"tiny": 2}}


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_longer_than_every_context_window_is_a_400_context_length_exceeded(starting, stream):
    url, output = starting
    wait_for(lambda: "ready: 2 workers serving" in output.read_text(), timeout_s=180)
    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as refused:
        response = client.completions.create(model="tiny", prompt="abc " * 600, max_tokens=4, stream=stream)
        list(response) if stream else None
    assert refused.value.status_code == 400 and refused.value.code == "context_length_exceeded"
    assert (
        client.completions.create(
            model="tiny", prompt="abc", max_tokens=2, extra_body={"ignore_eos": True}
        ).usage.completion_tokens
        == 2
    )
