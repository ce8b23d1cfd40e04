"""Streams that move with their KV cache, between real worker processes behind a real router.

Disaggregated prefill and decode answer token for token like a colocated worker (greedy, seeded,
n > 1, prompts longer than one prefill chunk), and the decode worker imports the prompt's blocks
instead of computing them; so does a model whose sliding-window layers keep KV groups of their
own. A draining worker hands its streams to another at their next token: they continue
token-exact, and the receiver computes none of their prompts again. A P/D pool that loses its
prefill worker still answers everything. A rolling restart moves streams the same way."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import threading

import httpx
import pytest
import yaml

from tests.support.family_variants import COMMON, LAYER_VARIANTS
from tests.support.routers import SECRET, start_router, stop
from tests.support.serving import shoal, supervised
from tests.support.streams import read_stream
from tests.support.tiny_model import write_random_family_model
from tests.support.workers import MODEL, scrape, spawn_worker, tiny_worker_args, wait_ready

BLOCK_SIZE = 16
LONG_PROMPT = "a dragon sleeps under the old mountain and dreams of gold " * 6  # several prefill chunks


def chat(content: str, seed: int | None, max_tokens: int = 24, **extra) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0 if seed is None else 0.9,
        "ignore_eos": True,
        "stream": True,
        **extra,
    }
    return body if seed is None else {**body, "seed": seed}


def counter(url: str, name: str) -> float:
    return sum(v for k, v in scrape(url).items() if k.startswith(name))


def pd_fleet(model_dir, shoal_cache_dir, tmp_path_factory):
    """A prefill and a decode worker behind one router, and a colocated worker behind another (the
    reference), all serving `model_dir` in small prefill chunks and with the cluster secret; yields
    (worker urls, router urls, worker processes) by name."""
    common = tiny_worker_args(model_dir, MODEL, "--max-num-batched-tokens", "64", "--block-size", str(BLOCK_SIZE))
    env = {"SHOAL_CLUSTER_SECRET": SECRET}
    workers = dict(
        zip(
            ("prefill", "decode", "colocated"),
            [
                wait_ready(*w)
                for w in [
                    spawn_worker(common + ["--role", role], shoal_cache_dir, env=env)
                    for role in ("prefill", "decode", "colocated")
                ]
            ],
        )
    )
    routers = {}
    for name, members in (("pd", ("prefill", "decode")), ("colocated", ("colocated",))):
        config = tmp_path_factory.mktemp(name) / "router.yaml"
        config.write_text(yaml.safe_dump({"workers": [{"url": workers[m][1]} for m in members]}))
        routers[name] = start_router(["--config", str(config)])
    yield {name: url for name, (_, url) in workers.items()}, {name: url for name, (_, url) in routers.items()}, workers
    for process, _ in routers.values():
        stop(process)
    for process, _ in workers.values():
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, shoal_cache_dir, tmp_path_factory):
    yield from pd_fleet(tiny_model_dir, shoal_cache_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def hybrid_fleet(shoal_cache_dir, tmp_path_factory):
    """The same over a Gemma 3 whose two windowed layers (21 tokens) and one global layer keep their
    KV in groups of their own (shoal.model.kv_groups)."""
    config_class, model_class, fields = LAYER_VARIANTS["gemma3"]
    directory = tmp_path_factory.mktemp("gemma3")
    fields = {**COMMON, **fields, "max_position_embeddings": 1024}
    write_random_family_model(directory, config_class, model_class, fields)
    yield from pd_fleet(directory, shoal_cache_dir, tmp_path_factory)


@pytest.mark.parametrize(
    ("content", "seed"),
    [("tell me a story", None), ("tell me a story", 11), (LONG_PROMPT, None), (LONG_PROMPT, 12)],
    ids=["greedy", "seeded", "long-greedy", "long-seeded"],
)
def test_prefill_and_decode_workers_answer_like_a_colocated_one_token_for_token(fleet, content, seed):
    workers, routers, _ = fleet
    imported_before = counter(workers["decode"], "shoal:kv_transfer_bytes_total")
    handoffs_before = counter(workers["prefill"], "shoal:kv_handoffs_total")
    colocated = read_stream(routers["colocated"], chat(content, seed))
    disaggregated = read_stream(routers["pd"], chat(content, seed))
    assert disaggregated["ids"] == colocated["ids"] and disaggregated["text"] == colocated["text"]
    assert len(disaggregated["response_ids"]) == 1 and disaggregated["roles"] == 1
    assert counter(workers["prefill"], "shoal:kv_handoffs_total") == handoffs_before + 1
    assert counter(workers["decode"], "shoal:kv_transfer_bytes_total") > imported_before  # the prompt's blocks
    assert counter(workers["decode"], "shoal:kv_import_failures_total") == 0
    spans = httpx.get(f"{workers['decode']}/debug/traces/{disaggregated['trace_id']}", timeout=10).json()["spans"]
    [transfer] = [span for span in spans if span["name"] == "kv.import"]  # in the request's trace
    assert transfer["attributes"]["shoal.kv_source"].startswith("tcp://127.0.0.1:")
    assert transfer["attributes"]["shoal.kv_blocks"] >= 1 and transfer["attributes"]["shoal.kv_bytes"] > 0


@pytest.mark.parametrize("seed", [None, 13], ids=["greedy", "seeded"])
def test_a_hybrid_kv_model_is_disaggregated_token_for_token(hybrid_fleet, seed):
    """Its windowed groups send only the blocks the decode worker's next query reaches."""
    workers, routers, _ = hybrid_fleet
    colocated = read_stream(routers["colocated"], chat(LONG_PROMPT, seed))
    disaggregated = read_stream(routers["pd"], chat(LONG_PROMPT, seed))
    assert disaggregated["ids"] == colocated["ids"] and disaggregated["text"] == colocated["text"]
    assert counter(workers["decode"], "shoal:kv_import_failures_total") == 0
    spans = httpx.get(f"{workers['decode']}/debug/traces/{disaggregated['trace_id']}", timeout=10).json()["spans"]
    [transfer] = [span for span in spans if span["name"] == "kv.import"]
    assert transfer["attributes"]["shoal.kv_blocks"] >= 1


def test_n_choices_and_non_streaming_requests_are_disaggregated_token_for_token(fleet):
    workers, routers, _ = fleet
    body = {**chat(LONG_PROMPT, seed=5), "stream": False, "n": 3}
    colocated = httpx.post(routers["colocated"] + "/v1/chat/completions", json=body, timeout=60).json()
    handoffs_before = counter(workers["prefill"], "shoal:kv_handoffs_total")
    disaggregated = httpx.post(routers["pd"] + "/v1/chat/completions", json=body, timeout=60).json()
    assert [c["message"]["content"] for c in disaggregated["choices"]] == [
        c["message"]["content"] for c in colocated["choices"]
    ]
    assert disaggregated["usage"] == colocated["usage"]
    assert counter(workers["prefill"], "shoal:kv_handoffs_total") == handoffs_before + 3


def test_the_decode_worker_computes_only_the_prompts_last_partial_block(fleet):
    """Read from the decode worker's trace of the request, attempt by attempt: on a loaded machine
    the router may take the stream off the decode worker for looking hung and give it back with
    more tokens to resume from, which is another attempt, not a block computed again."""
    workers, routers, _ = fleet
    prompt = LONG_PROMPT + "and a new ending"  # not cached anywhere yet
    failures_before = counter(workers["decode"], "shoal:kv_import_failures_total")
    response = httpx.post(
        routers["pd"] + "/v1/chat/completions", json={**chat(prompt, None), "stream": False}, timeout=60
    )
    assert response.json()["usage"]["prompt_tokens"] > 4 * BLOCK_SIZE
    assert counter(workers["decode"], "shoal:kv_import_failures_total") == failures_before
    trace = httpx.get(f"{workers['decode']}/debug/traces/{response.headers['x-shoal-trace-id']}", timeout=10).json()
    prefills = [span["attributes"] for span in trace["spans"] if span["name"] == "engine.prefill"]
    # the prompt and the tokens resumed from, less what the cache held: what lies past the last
    # full block, never a full block again
    computed = [a["shoal.prompt_tokens"] + a["shoal.resumed_tokens"] - a["shoal.cached_tokens"] for a in prefills]
    assert computed and all(1 <= c <= BLOCK_SIZE for c in computed), computed


def test_a_client_cannot_name_a_kv_source(fleet):
    _, routers, _ = fleet
    response = httpx.post(
        routers["pd"] + "/v1/chat/completions",
        json={**chat("hello", None), "kv_source": "tcp://10.0.0.1:1"},
        timeout=30,
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "kv_source"


def test_a_draining_worker_hands_its_streams_over_with_their_kv(fleet, tiny_model_dir, shoal_cache_dir, tmp_path):
    """Two colocated workers at 40 ms a step serve four seeded streams; once all are 30 tokens in,
    the worker of the first gets SIGTERM. Its streams go on at the other worker token for token,
    whose counters show the imported blocks and none of their prompts computed again; the drained
    worker exits 0 long before its grace period ends. The references come from the fleet's own
    colocated worker, so neither of the two has any of these prompts cached beforehand."""
    _, routers, _ = fleet
    common = tiny_worker_args(tiny_model_dir, MODEL, "--block-size", str(BLOCK_SIZE), step_delay_ms=40)
    env = {"SHOAL_CLUSTER_SECRET": SECRET}
    spawned = [spawn_worker(common + ["--drain-grace-s", "60"], shoal_cache_dir, env=env) for _ in range(2)]
    processes = {url: process for process, url in (wait_ready(*w) for w in spawned)}
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"workers": [{"url": u} for u in processes], "policy": "round_robin"}))
    router, url = start_router(["--config", str(config)])
    prompts = [f"story number {i}: " + LONG_PROMPT[: 100 + 20 * i] for i in range(4)]

    def body(i: int) -> dict:
        # Long enough (10 s at 40 ms a step) that no stream can end while the slowest is still
        # reaching its 30th token (readers wait at the barrier, the workers do not), even on a loaded
        # machine: each has output left to hand over.
        return chat(prompts[i], seed=30 + i, max_tokens=240, stream_options={"include_usage": True})

    try:
        # The references run side by side: batch shapes do not change seeded outputs.
        with concurrent.futures.ThreadPoolExecutor(4) as pool:
            clean = list(pool.map(lambda i: read_stream(routers["colocated"], body(i)), range(4)))
        started_on: list[str | None] = [None] * 4
        results: list[dict | None] = [None] * 4
        all_under_way = threading.Barrier(5)

        def follow(i: int) -> None:
            def under_way(worker: str) -> None:
                started_on[i] = worker
                all_under_way.wait(timeout=60)

            results[i] = read_stream(url, body(i), fault=under_way, after_tokens=30)

        threads = [threading.Thread(target=follow, args=(i,)) for i in range(4)]
        for thread in threads:
            thread.start()
        all_under_way.wait(timeout=60)
        victim = started_on[0]
        [receiver] = [u for u in processes if u != victim]
        moved = [i for i in range(4) if started_on[i] == victim]
        hits_before = counter(receiver, "shoal:prefix_cache_hits_total")
        computed_before = counter(receiver, "shoal:prompt_tokens_computed_total")
        blocks_before = counter(receiver, "shoal:kv_transfer_blocks_total")
        os.kill(processes[victim].pid, signal.SIGTERM)
        for thread in threads:
            thread.join(timeout=120)
        for result, reference in zip(results, clean, strict=True):
            assert result is not None and result["ids"] == reference["ids"] and result["text"] == reference["text"]
            assert len(result["response_ids"]) == 1 and result["usage"] == reference["usage"]
        assert processes[victim].wait(timeout=30) == 0
        assert counter(receiver, "shoal:kv_transfer_blocks_total") > blocks_before
        assert counter(receiver, "shoal:kv_import_failures_total") == 0
        # every moved stream's prompt came from the imported blocks; only what lay past each one's
        # last full block (output tokens) was computed
        hits = counter(receiver, "shoal:prefix_cache_hits_total") - hits_before
        assert hits >= sum(clean[i]["usage"]["prompt_tokens"] for i in moved)
        assert counter(receiver, "shoal:prompt_tokens_computed_total") - computed_before <= len(moved) * BLOCK_SIZE
        assert counter(url, "shoal_router_handoffs_total") == len(moved)
        assert counter(url, "shoal_router_migrations_total") == 0
    finally:
        stop(router)
        for process in processes.values():
            if process.poll() is None:
                process.kill()
            process.wait(timeout=30)


def test_a_pd_pool_that_loses_its_prefill_worker_still_answers(fleet):
    """Runs last in this module: it kills the fleet's prefill worker."""
    workers, routers, processes = fleet
    expected = read_stream(routers["colocated"], chat("one more story", seed=77))
    processes["prefill"][0].kill()
    processes["prefill"][0].wait(timeout=30)
    after = read_stream(routers["pd"], chat("one more story", seed=77))
    assert after["ids"] == expected["ids"] and after["worker"] == workers["decode"]


def test_a_decode_worker_killed_mid_stream_costs_a_recompute_not_the_stream(tiny_model_dir, shoal_cache_dir, tmp_path):
    """Kill -9 of the decode worker 30 tokens into a P/D stream: the stream goes on at the prefill
    worker (the only one left, which then keeps it), token for token."""
    common = tiny_worker_args(tiny_model_dir, MODEL, "--block-size", str(BLOCK_SIZE), step_delay_ms=20)
    env = {"SHOAL_CLUSTER_SECRET": SECRET}
    spawned = [spawn_worker(common + ["--role", role], shoal_cache_dir, env=env) for role in ("prefill", "decode")]
    (_, prefill), (decode_process, _) = [wait_ready(*w) for w in spawned]
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"workers": [{"url": url} for _, url in spawned]}))
    router, url = start_router(["--config", str(config)])
    try:
        body = chat("a story that survives", seed=9, max_tokens=120, stream_options={"include_usage": True})
        clean = read_stream(url, body)
        faulty = read_stream(url, body, fault=lambda _: decode_process.kill(), after_tokens=30)
        assert faulty["ids"] == clean["ids"] and faulty["usage"] == clean["usage"]
        assert counter(url, "shoal_router_migrations_total") == 1
        assert counter(url, "shoal_router_handoffs_total") == 2  # one per run, none from the continuation
        assert counter(prefill, "shoal:kv_handoffs_total") == 2
    finally:
        stop(router)
        for process, _ in spawned:
            process.kill()
            process.wait(timeout=30)


def test_a_rolling_restart_moves_streams_with_their_kv_token_for_token(deploy):
    """`shoal restart` under three clients' seeded streams: each old worker hands its streams to
    the others as it drains, and every stream equals its fault-free run."""
    _, url, state_dir, _ = deploy(replicas=2, step_delay_ms=20, block_size=BLOCK_SIZE)
    bodies = [
        chat(
            f"restart story {i}: " + LONG_PROMPT[:120],
            seed=50 + i,
            max_tokens=150,
            stream_options={"include_usage": True},
        )
        for i in range(3)
    ]
    clean = [read_stream(url, body) for body in bodies]
    results: list[tuple[int, dict]] = []
    done = threading.Event()

    def client(i: int) -> None:
        while not done.is_set():
            results.append((i, read_stream(url, bodies[i])))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    try:
        restarted = shoal("restart", "tiny", "--state-dir", str(state_dir))
    finally:
        done.set()
        for thread in threads:
            thread.join(timeout=120)
    assert restarted.returncode == 0 and "2 replicas of tiny replaced" in restarted.stdout, restarted.stdout
    assert results and all(r["ids"] == clean[i]["ids"] and r["usage"] == clean[i]["usage"] for i, r in results)
    assert counter(url, "shoal_router_handoffs_total") > 0 and counter(url, "shoal_router_migrations_total") == 0
    new_workers = [s["url"] for s in supervised(state_dir)]
    assert sum(counter(w, "shoal:kv_transfer_blocks_total[('direction', 'in')]") for w in new_workers) > 0
    assert sum(counter(w, "shoal:kv_import_failures_total") for w in new_workers) == 0
