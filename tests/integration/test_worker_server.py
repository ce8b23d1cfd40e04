"""A real worker process on loopback, driven with the official openai client."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

MODEL = "tiny"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_worker(args: list[str], cache_dir) -> tuple[subprocess.Popen, str]:
    """Starts `shoal worker ARGS` on a free loopback port; returns once /ready answers 200."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "shoal.cli", "worker", "--port", str(port), *args],
                               env={**os.environ, "SHOAL_CACHE_DIR": str(cache_dir)}, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.2)
    process.kill()
    pytest.fail(f"worker did not start: {process.stderr.read().decode()[-2000:]}")


@pytest.fixture(scope="module")
def worker_url(tiny_model_dir, shoal_cache_dir):
    process, url = start_worker(["--model", str(tiny_model_dir), "--dtype", "float32", "--served-model-name", MODEL,
                                 "--kv-cache-bytes", str(8 << 20)], shoal_cache_dir)
    yield url
    process.terminate()
    process.wait(timeout=30)


@pytest.fixture
def client(worker_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=worker_url + "/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


def test_completion_with_usage_and_token_ids(client):
    result = client.completions.create(model=MODEL, prompt="hello", max_tokens=6, temperature=0,
                                       extra_body={"ignore_eos": True})
    choice = result.choices[0]
    assert choice.finish_reason == "length" and len(choice.model_extra["token_ids"]) == 6
    assert result.usage.completion_tokens == 6 and result.usage.prompt_tokens == 5


def test_streamed_text_equals_non_streamed_for_the_same_seed(client):
    args = dict(model=MODEL, messages=[{"role": "user", "content": "tell me"}], max_tokens=12, seed=5,
                temperature=0.9, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**args)
    chunks = list(client.chat.completions.create(**args, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    token_ids = [t for c in chunks if c.choices for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
    assert text == full.choices[0].message.content
    assert token_ids == full.choices[0].model_extra["token_ids"]
    assert chunks[-1].usage.completion_tokens == 12


def test_n_choices_and_stop_sequences(client):
    result = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=8, n=3, temperature=1.0, seed=1,
                                       extra_body={"ignore_eos": True})
    assert sorted(c.index for c in result.choices) == [0, 1, 2]
    text = result.choices[0].text
    assert len(text) >= 2
    stopped = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=8, temperature=1.0, seed=1,
                                        stop=[text[1:3]], extra_body={"ignore_eos": True})
    assert stopped.choices[0].finish_reason == "stop" and text[1:3] not in stopped.choices[0].text


@pytest.mark.parametrize("body,status", [
    ({"model": MODEL, "prompt": "x", "max_tokens": -3}, 400),
    ({"model": MODEL, "prompt": "x", "max_tokens": 10 ** 12}, 400),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400),
    ({"model": MODEL, "prompt": ""}, 400),
    ({"model": MODEL, "prompt": "x" * 2000}, 400),
    ({"model": "other", "prompt": "x"}, 404),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400),
])
def test_bad_input_gets_openai_errors_and_the_worker_keeps_serving(worker_url, client, body, status):
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    response = httpx.post(worker_url + path, json=body, timeout=30)
    assert response.status_code == status
    assert set(response.json()["error"]) >= {"message", "type", "code"}
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=2).choices[0].text is not None


def test_malformed_json_is_a_400(worker_url):
    response = httpx.post(worker_url + "/v1/completions", content=b"{not json", timeout=30,
                          headers={"content-type": "application/json"})
    assert response.status_code == 400


def test_client_disconnect_mid_stream_frees_the_request(worker_url):
    body = {"model": MODEL, "prompt": "a long story", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", worker_url + "/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
        assert httpx.get(worker_url + "/load").json()["running"] == 1
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        load = httpx.get(worker_url + "/load").json()
        if load["running"] == 0 and load["waiting"] == 0:
            break
        time.sleep(0.1)
    assert load["running"] == 0 and load["free_kv_blocks"] == load["num_kv_blocks"]


def test_logprobs_in_completions_and_chat(client):
    completion = client.completions.create(model=MODEL, prompt="hi", max_tokens=3, temperature=0, logprobs=2,
                                           extra_body={"ignore_eos": True})
    lp = completion.choices[0].logprobs
    assert len(lp.token_logprobs) == 3 and all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) == 2 for top in lp.top_logprobs)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                          temperature=0, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    # Greedy: the sampled token is the most likely one.
    assert all(c.logprob == max(t.logprob for t in c.top_logprobs) for c in content)
