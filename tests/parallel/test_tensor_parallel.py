"""Tensor parallelism: on SmolLM2 (3 KV heads) TP=2 and TP=3 give the single process's greedy and
seeded tokens and logprobs at batch 4 and 1, in every dtype; a rank that dies takes its replica down
as a whole, and the router carries the replica's stream on elsewhere, token for token."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import psutil
import pytest

from shoal.engine.sampling_params import SamplingParams
from shoal.llm import LLM
from tests.support.fleet import admin, router_config, start
from tests.support.prompts import TEXT_PROMPTS
from tests.support.routers import stop
from tests.support.tiny_model import write_random_family_model
from tests.support.waiting import wait_for
from tests.support.workers import MODEL, spawn_worker, tiny_worker_args, wait_ready

# A tiny model whose three KV heads give TP=3 one each.
THREE_KV_HEADS = dict(
    vocab_size=128,
    hidden_size=96,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=6,
    num_key_value_heads=3,
    head_dim=16,
    bos_token_id=1,
    eos_token_id=2,
)


def generated(model: str, prompts: list, cache_dir, params: list, **options) -> list:
    """(tokens, logprobs) of every prompt run together, then of the first alone."""
    llm = LLM(model, kv_cache_bytes=16 << 20, cache_dir=str(cache_dir), **options)
    try:
        outputs = [o.outputs[0] for o in llm.generate(prompts, params)] + [
            llm.generate(prompts[0], params[0])[0].outputs[0]
        ]
        return [(o.token_ids, o.logprobs) for o in outputs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("dtype", ["auto", "bfloat16", "float32"])
def test_every_degree_gives_the_single_process_tokens_and_logprobs_on_smollm2(dtype, shoal_cache_dir):
    """auto: float32 activations on the GGUF's quantized blocks. TP=2 splits the 3 KV heads 2 + 1,
    TP=3 one each; both give the single process's greedy and seeded tokens and the same logprobs,
    to the bit."""
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=8, ignore_eos=True, logprobs=2)
        for i in range(4)
    ]
    run = dict(model="smollm2-135m-instruct", prompts=TEXT_PROMPTS[:4], cache_dir=shoal_cache_dir, params=params)
    single = generated(**run, dtype=dtype)
    for size in (2, 3):
        assert generated(**run, dtype=dtype, tensor_parallel_size=size) == single, size


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_tp2_gives_the_single_process_tokens_on_gemma_3s_layer(dtype, shoal_cache_dir, tmp_path):
    """Norms after attention and the MLP need whole rows: each rank projects its columns, they are
    gathered, then joined, as one process joins them; q/k norms and the local layers' RoPE base."""
    fields = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=5,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        bos_token_id=1,
        eos_token_id=2,
    )
    write_random_family_model(tmp_path, "Gemma3TextConfig", "Gemma3ForCausalLM", fields)
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=8, ignore_eos=True, logprobs=2)
        for i in range(4)
    ]
    run = dict(model=str(tmp_path), prompts=TEXT_PROMPTS[:4], cache_dir=shoal_cache_dir, params=params)
    assert generated(**run, dtype=dtype, tensor_parallel_size=2) == generated(**run, dtype=dtype)


@pytest.mark.parametrize(
    "family",
    [
        ("Gemma2Config", "Gemma2ForCausalLM", dict(sliding_window=5, attn_logit_softcapping=2.0)),
        ("Phi3Config", "Phi3ForCausalLM", dict(partial_rotary_factor=0.75, pad_token_id=0)),
        ("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True)),
    ],
    ids=["gemma2", "phi4-mini-partial", "qwen3"],
)
def test_tp3_gives_the_single_process_tokens_per_family(family, shoal_cache_dir, tmp_path):
    """Three KV heads, one a rank: soft caps and norms after (Gemma 2), fused projections split and
    partial rotary (Phi-4-mini's shape), per-head q/k norms (Qwen3), in float32."""
    config_class, model_class, extra = family
    fields = {**THREE_KV_HEADS, **extra}
    write_random_family_model(tmp_path, config_class, model_class, fields)
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=8, ignore_eos=True) for i in range(2)
    ]
    run = dict(model=str(tmp_path), prompts=TEXT_PROMPTS[:2], cache_dir=shoal_cache_dir, params=params)
    assert generated(**run, dtype="float32", tensor_parallel_size=3) == generated(**run, dtype="float32")


@pytest.mark.parametrize(
    ("family", "size", "dtype"),
    [
        (("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=6, num_experts_per_tok=2)), 2, "bfloat16"),
        (
            (
                "Qwen3MoeConfig",
                "Qwen3MoeForCausalLM",
                dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=True),
            ),
            3,
            "float32",
        ),
        (
            (
                "GptOssConfig",
                "GptOssForCausalLM",
                dict(
                    num_local_experts=4,
                    num_experts_per_tok=2,
                    intermediate_size=48,
                    sliding_window=5,
                    swiglu_limit=1.0,
                ),
            ),
            3,
            "bfloat16",
        ),
    ],
    ids=["mixtral-tp2", "qwen3-moe-tp3", "gpt-oss-tp3"],
)
def test_a_mixture_of_experts_split_by_expert_columns_gives_the_single_process_tokens(
    family, size, dtype, shoal_cache_dir, tmp_path
):
    """Each rank holds its columns of every expert's intermediate and of the hidden state; the router
    is whole on every rank, the activations are gathered between the experts' two projections; gpt-oss's
    attention sinks go with their query heads, its expert biases with their columns."""
    assert_tensor_parallel_moe_tokens(family, size, dtype, shoal_cache_dir, tmp_path)


@pytest.mark.parametrize(
    ("family", "size"),
    [
        (("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=6, num_experts_per_tok=2)), 2),
        (
            (
                "GptOssConfig",
                "GptOssForCausalLM",
                dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=48, swiglu_limit=1.0),
            ),
            3,
        ),
    ],
    ids=["mixtral-ep2", "gpt-oss-ep3"],
)
def test_a_mixture_of_experts_split_by_expert_gives_the_single_process_tokens(family, size, shoal_cache_dir, tmp_path):
    """Expert parallelism: each rank holds whole experts (3 and 3; 2, 1 and 1), attention is split as
    before; the experts' outputs are summed over the ranks, then weighted on each."""
    assert_tensor_parallel_moe_tokens(family, size, "bfloat16", shoal_cache_dir, tmp_path, enable_expert_parallel=True)


def assert_tensor_parallel_moe_tokens(family, size, dtype, shoal_cache_dir, tmp_path, **options) -> None:
    """A random model of `family` on `size` ranks (with `options`) gives one process's tokens and
    logprobs, batched and alone, greedy and seeded."""
    config_class, model_class, extra = family
    fields = {**THREE_KV_HEADS, **extra}
    write_random_family_model(tmp_path, config_class, model_class, fields)
    params = [
        SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=8, ignore_eos=True, logprobs=2)
        for i in range(4)
    ]
    run = dict(model=str(tmp_path), prompts=TEXT_PROMPTS[:4], cache_dir=shoal_cache_dir, params=params)
    assert generated(**run, dtype=dtype, tensor_parallel_size=size, **options) == generated(**run, dtype=dtype)


def test_more_ranks_than_kv_heads_is_refused(tiny_model_dir, shoal_cache_dir):
    with pytest.raises(ValueError, match="exceeds the model's 2 KV heads"):
        LLM(str(tiny_model_dir), dtype="float32", cache_dir=str(shoal_cache_dir), tensor_parallel_size=3)


def stream_tokens(url: str, on_token=None) -> tuple[list[int], str]:
    """One seeded chat stream through the router; its token ids and the worker that began it.
    on_token(worker, count) runs after each event with tokens."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "a long story"}],
        "max_tokens": 80,
        "temperature": 0.8,
        "seed": 3,
        "ignore_eos": True,
        "stream": True,
    }
    ids = []
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        worker = response.headers["x-shoal-worker"]
        for line in response.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                ids += event["choices"][0].get("token_ids") or [] if event["choices"] else []
                if on_token:
                    on_token(worker, len(ids))
    return ids, worker


def test_killing_a_rank_fails_the_replica_and_its_stream_continues_elsewhere(tiny_model_dir, shoal_cache_dir, tmp_path):
    common = tiny_worker_args(tiny_model_dir, MODEL, step_delay_ms=20)
    logs = [open(tmp_path / f"worker-{i}.log", "wb") for i in range(2)]
    sharded, sharded_url = wait_ready(
        *spawn_worker(common + ["--tensor-parallel-size", "2"], shoal_cache_dir, stderr=logs[0])
    )
    plain, plain_url = wait_ready(*spawn_worker(common, shoal_cache_dir, stderr=logs[1]))
    router, url = start(router_config(tmp_path, [sharded_url, plain_url], policy="round_robin"))
    try:
        reference, _ = stream_tokens(url)
        follower = psutil.Process(sharded.pid).children()[0]
        killed = []

        def kill_rank(worker: str, count: int) -> None:
            if worker == sharded_url and count >= 20 and not killed:
                follower.kill()
                killed.append(count)

        for _ in range(4):  # until the router starts a stream on the sharded replica
            ids, worker = stream_tokens(url, kill_rank)
            assert ids == reference
            if killed:
                break
        assert killed, "no stream was placed on the tensor-parallel replica"
        assert sharded.wait(timeout=30) == 70
        # Whichever notices first, the watch on the rank's process or the collective it broke off.
        assert re.search(
            r"replica failed \((tensor-parallel rank 1 exited|a tensor-parallel collective failed)",
            (tmp_path / "worker-0.log").read_text(),
        )
        wait_for(lambda: not next(w for w in admin(url)["workers"] if w["worker_id"] == sharded_url)["healthy"])
    finally:
        stop(router)
        for process in (sharded, plain):
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)


def test_a_rank_that_dies_before_joining_fails_the_start_at_once(tiny_model_dir, shoal_cache_dir):
    """Rank 0 waits for its followers to join, watching them: one killed while loading fails the
    replica's start there and then, not at the rendezvous timeout."""
    from shoal.config.engine import EngineConfig
    from shoal.errors import ReplicaFailedError
    from shoal.parallel.tensor_group import START_TIMEOUT_S, TensorParallelGroup

    def kill_the_follower() -> None:
        follower = wait_for(
            lambda: [p for p in psutil.Process().children() if "shoal.parallel.tensor_group" in " ".join(p.cmdline())]
        )[0]
        follower.kill()

    killer = threading.Thread(target=kill_the_follower)
    killer.start()
    started = time.monotonic()
    with pytest.raises(ReplicaFailedError, match="rank 1 exited with status -9 before joining"):
        TensorParallelGroup(
            EngineConfig(model=str(tiny_model_dir), tensor_parallel_size=2, cache_dir=str(shoal_cache_dir))
        )
    killer.join()
    assert time.monotonic() - started < START_TIMEOUT_S / 2
    assert not [p for p in psutil.Process().children() if "shoal.parallel.tensor_group" in " ".join(p.cmdline())]
