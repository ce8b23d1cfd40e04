"""`/v1/embeddings` on a real worker, through the official openai client: a decoder used as an
embedder (the tiny Llama, float32) gives transformers' final hidden states pooled the same way
(the last token's, or the mean; normalised or not) within 1e-5, for inputs longer than a prefill
chunk, alone and in a batch of inputs; base64 equals floats; `dimensions` truncates and
renormalises; bad input is a 400 naming the field. Through a router the answers are the worker's,
and a worker that is gone (kill -9) is passed over for one that answers."""

from __future__ import annotations

import base64

import httpx
import numpy
import openai
import pytest
import torch
import yaml

from tests.support.routers import start_router, stop
from tests.support.workers import MODEL, start_worker, tiny_worker_args

INPUTS = [[5 + (7 * i) % 90 for i in range(40)], [3, 4, 5], [60 + i % 7 for i in range(23)]]


@pytest.fixture(scope="module")
def workers(tiny_model_dir, shoal_cache_dir):
    """Two workers: last-token pooling, normalised (the default); mean pooling, as it is. Prefill
    chunks of 16 tokens, so the longest input runs in three."""
    common = tiny_worker_args(tiny_model_dir, MODEL, "--max-num-batched-tokens", "16")
    started = {
        "last": start_worker(common, shoal_cache_dir),
        "mean": start_worker(common + ["--embedding-pooling", "mean", "--no-embedding-normalize"], shoal_cache_dir),
    }
    yield {name: url for name, (_, url) in started.items()}
    for process, _ in started.values():
        process.kill()
        process.wait(timeout=30)


def reference(model_dir, inputs: list[list[int]], pooling: str, normalize: bool) -> list[torch.Tensor]:
    import transformers

    model = transformers.AutoModel.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    vectors = []
    with torch.no_grad():
        for ids in inputs:
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
            pooled = hidden[-1] if pooling == "last" else hidden.mean(dim=0)
            vectors.append(torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled)
    return vectors


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


@pytest.mark.parametrize(("pooling", "normalize"), [("last", True), ("mean", False)])
def test_embeddings_are_transformers_hidden_states_pooled(workers, tiny_model_dir, pooling, normalize):
    batch = client(workers[pooling]).embeddings.create(model=MODEL, input=INPUTS)
    assert [item.index for item in batch.data] == [0, 1, 2]
    assert batch.usage.prompt_tokens == sum(map(len, INPUTS))
    for item, expected in zip(batch.data, reference(tiny_model_dir, INPUTS, pooling, normalize), strict=True):
        assert torch.allclose(torch.tensor(item.embedding), expected, atol=1e-5, rtol=0)
    alone = client(workers[pooling]).embeddings.create(model=MODEL, input=INPUTS[2])
    assert alone.data[0].embedding == batch.data[2].embedding


def test_base64_and_dimensions(workers):
    url = workers["last"]
    floats = client(url).embeddings.create(model=MODEL, input=INPUTS[0]).data[0].embedding
    raw = httpx.post(
        url + "/v1/embeddings", json={"model": MODEL, "input": INPUTS[0], "encoding_format": "base64"}, timeout=30
    ).json()["data"][0]["embedding"]
    assert numpy.frombuffer(base64.b64decode(raw), dtype="<f4").tolist() == pytest.approx(floats, abs=0)
    short = client(url).embeddings.create(model=MODEL, input=INPUTS[0], dimensions=8).data[0].embedding
    expected = torch.nn.functional.normalize(torch.tensor(floats[:8]), dim=0)
    assert len(short) == 8 and torch.allclose(torch.tensor(short), expected, atol=1e-6)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": []}, "input"),
        ({"input": ""}, "input"),
        ({"input": [[1, 2], []]}, "input"),
        ({"input": [1, 2], "dimensions": 100000}, "dimensions"),
        ({"input": [1, 2], "encoding_format": "int8"}, "encoding_format"),
        ({"input": [1, 999999]}, "prompt"),
        ({"input": [1, 2], "model": "other"}, "model"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(workers, fields, param):
    response = httpx.post(workers["last"] + "/v1/embeddings", json={"model": MODEL, **fields}, timeout=30)
    assert response.status_code in (400, 404) and response.json()["error"]["param"].startswith(param)


def test_through_a_router_a_gone_worker_is_passed_over(workers, tiny_model_dir, shoal_cache_dir, tmp_path):
    process, spare = start_worker(
        tiny_worker_args(tiny_model_dir, MODEL, "--max-num-batched-tokens", "16"), shoal_cache_dir
    )
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"workers": [{"url": workers["last"]}, {"url": spare}], "policy": "round_robin"}))
    router, url = start_router(["--config", str(config)])
    try:
        direct = client(workers["last"]).embeddings.create(model=MODEL, input=INPUTS).data
        routed = client(url).embeddings.create(model=MODEL, input=INPUTS).data
        assert [d.embedding for d in routed] == [d.embedding for d in direct]
        process.kill()
        process.wait(timeout=30)
        for _ in range(4):  # round robin sends some to the gone worker: each goes on to the other
            assert client(url).embeddings.create(model=MODEL, input=INPUTS[1]).data[0].embedding == direct[1].embedding
    finally:
        stop(router)
