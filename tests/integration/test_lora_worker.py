"""LoRA adapters through a real worker's HTTP server and the official `openai` client, as vLLM
serves them: an adapter is a `model` (listed with the base as its parent), its tokens are the
engine's for it; adapters load and unload at run time from under the worker's lora_dir only; an
unknown one is a 404 naming it; a bad one is a 400 with the reason, and the worker goes on serving."""

from __future__ import annotations

import httpx
import openai
import pytest

from shoal.engine.sampling_params import SamplingParams
from tests.support.lora_adapters import tokens_with_adapter, write_adapter
from tests.support.routers import stop
from tests.support.workers import MODEL, start_worker, tiny_worker_args

PROMPT = [5, 17, 42, 8, 99, 23, 61]


@pytest.fixture(scope="module")
def lora_dir(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-dir")
    write_adapter(tiny_model_dir, root / "a0", rank=8)
    write_adapter(tiny_model_dir, root / "a1", rank=4)
    write_adapter(tiny_model_dir, root / "wide", rank=32)
    write_adapter(tiny_model_dir, root / "broken", rank=4)
    weights = root / "broken" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:64])
    return root


@pytest.fixture(scope="module")
def worker(tiny_model_dir, shoal_cache_dir, lora_dir):
    args = tiny_worker_args(
        tiny_model_dir,
        MODEL,
        "--enable-lora",
        "--max-loras",
        "2",
        "--lora-modules",
        f"a0={lora_dir / 'a0'}",
        "--lora-dir",
        str(lora_dir),
    )
    process, url = start_worker(args, shoal_cache_dir)
    yield url
    stop(process)


def engine_tokens(tiny_model_dir, shoal_cache_dir, lora_dir, name: str | None) -> list[int]:
    modules = (f"a0={lora_dir / 'a0'}", f"a1={lora_dir / 'a1'}")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    return tokens_with_adapter(tiny_model_dir, shoal_cache_dir, modules, PROMPT, params, name)


def complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    return httpx.post(url + "/v1/completions", json=body, timeout=60)


def test_an_adapter_is_a_model_with_the_base_as_parent(worker, tiny_model_dir, shoal_cache_dir, lora_dir):
    client = openai.OpenAI(base_url=worker + "/v1", api_key="unused", max_retries=0)
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {MODEL, "a0"} and cards["a0"].model_extra["parent"] == MODEL
    answer = client.completions.create(
        model="a0", prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert answer.model == "a0"
    assert answer.choices[0].model_extra["token_ids"] == engine_tokens(tiny_model_dir, shoal_cache_dir, lora_dir, "a0")
    base = complete(worker, MODEL).json()["choices"][0]["token_ids"]
    assert (
        base
        == engine_tokens(tiny_model_dir, shoal_cache_dir, lora_dir, None)
        != answer.choices[0].model_extra["token_ids"]
    )
    with pytest.raises(openai.NotFoundError, match="model 'a9' is not served here"):
        client.chat.completions.create(model="a9", messages=[{"role": "user", "content": "hi"}], max_tokens=4)


def test_adapters_load_and_unload_at_run_time_from_under_the_lora_dir(
    worker, tiny_model_dir, shoal_cache_dir, lora_dir
):
    assert complete(worker, "a1").status_code == 404
    loaded = httpx.post(worker + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": "a1"}, timeout=60)
    assert loaded.status_code == 200, loaded.text
    assert complete(worker, "a1").json()["choices"][0]["token_ids"] == engine_tokens(
        tiny_model_dir, shoal_cache_dir, lora_dir, "a1"
    )
    assert httpx.post(worker + "/v1/unload_lora_adapter", json={"lora_name": "a1"}, timeout=60).status_code == 200
    assert complete(worker, "a1").status_code == 404
    unknown = httpx.post(worker + "/v1/unload_lora_adapter", json={"lora_name": "a1"}, timeout=60)
    assert unknown.status_code == 404 and "no LoRA adapter named 'a1'" in unknown.json()["error"]["message"]


@pytest.mark.parametrize(
    ("path", "status", "message"),
    [
        ("/etc", 400, "lora_path '/etc' is outside this worker's lora_dir"),
        ("../a0", 400, "is outside this worker's lora_dir"),
        ("broken", 400, "adapter_model.safetensors: not a safetensors file"),
        ("wide", 400, "rank 32 is above this engine's max_lora_rank 16"),
        ("missing", 400, "adapter_config.json: cannot be read"),
    ],
)
def test_a_bad_adapter_is_a_400_with_the_reason_and_the_worker_goes_on(worker, path, status, message):
    refused = httpx.post(worker + "/v1/load_lora_adapter", json={"lora_name": "bad", "lora_path": path}, timeout=60)
    assert refused.status_code == status, refused.text
    assert message in refused.json()["error"]["message"]
    assert complete(worker, "a0").status_code == 200 and complete(worker, "bad").status_code == 404


def test_the_load_report_names_the_adapters_served_and_those_held(tiny_model_dir, shoal_cache_dir, lora_dir):
    """With room for one adapter in memory, each request for the other reads it again (off the
    engine thread) and gives the first back; the load report says which is held and a read's time."""
    args = tiny_worker_args(
        tiny_model_dir,
        MODEL,
        "--enable-lora",
        "--max-loras",
        "1",
        "--max-cpu-loras",
        "1",
        "--lora-modules",
        f"a0={lora_dir / 'a0'},a1={lora_dir / 'a1'}",
        "--lora-dir",
        str(lora_dir),
    )
    process, url = start_worker(args, shoal_cache_dir)
    try:
        for name in ("a0", "a1", "a0"):
            answer = complete(url, name)
            assert answer.json()["choices"][0]["token_ids"] == engine_tokens(
                tiny_model_dir, shoal_cache_dir, lora_dir, name
            )
            lora = httpx.get(url + "/load").json()["lora"]
            assert lora["adapters"] == ["a0", "a1"] and lora["held"] == [name] and lora["loading"] == []
            assert lora["load_s"] > 0 and lora["on_demand"] is True
        other = httpx.post(url + "/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": "a0"}, timeout=60)
        assert other.status_code == 400 and "already loaded from" in other.json()["error"]["message"]
        same = {"lora_name": "a1", "lora_path": "a1"}  # its --lora-modules path: loaded again, it is held
        assert httpx.post(url + "/v1/load_lora_adapter", json=same, timeout=60).status_code == 200
        assert httpx.get(url + "/load").json()["lora"]["held"] == ["a1"]
    finally:
        stop(process)
