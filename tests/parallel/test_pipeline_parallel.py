"""Pipeline parallelism: PP=2, and PP=3 with uneven layer counts, give the single-process engine's
greedy tokens at batch 1 and 8 (tiny model in float32, SmolLM2 in bfloat16, whose 16-bit
activations travel losslessly); a stage killed or hung in the middle of generation is replaced,
rebuilds its KV cache from the boundary log, and the output is the output without the failure."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

from shoal.engine.async_engine import AsyncLLMEngine
from shoal.engine.sampling_params import SamplingParams
from shoal.errors import ReplicaFailedError
from shoal.llm import LLM
from shoal.parallel.pipeline import PipelineSettings
from shoal.parallel.pipeline_plan import plan_stages
from shoal.parallel.stage_links import StageHandle
from shoal.processes import free_port
from shoal.protocol.cluster_secret import SECRET_ENV
from tests.support.family_variants import COMMON, LAYER_VARIANTS
from tests.support.fork_server import ForkedProcess, start_shoal
from tests.support.prompts import TEXT_PROMPTS, TINY_PROMPTS
from tests.support.tiny_model import write_random_family_model, write_tiny_model
from tests.support.waiting import wait_for


@pytest.fixture(scope="module")
def five_layer_model(tmp_path_factory):
    return str(write_tiny_model(tmp_path_factory.mktemp("tiny-5-layers"), num_layers=5))


def outputs(llm: LLM, prompts: list, params: SamplingParams) -> list[list[int]]:
    try:
        batched = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        return batched + [llm.generate(prompts[0], params)[0].outputs[0].token_ids]
    finally:
        llm.shutdown()


GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, seed=5, max_tokens=60, ignore_eos=True)
TINY_OPTIONS = dict(dtype="float32", kv_cache_bytes=16 << 20)


@pytest.fixture(scope="module")
def sampled_on_one_process(five_layer_model, shoal_cache_dir) -> list[list[int]]:
    """The single process's SAMPLED tokens for the tiny prompts: what every failure must not change."""
    return outputs(LLM(five_layer_model, cache_dir=str(shoal_cache_dir), **TINY_OPTIONS), TINY_PROMPTS, SAMPLED)


@pytest.mark.parametrize("stages,layers_per_stage", [(2, None), (3, (2, 2, 1))])
def test_tiny_model_pipelines_give_the_single_process_tokens(
    five_layer_model, shoal_cache_dir, stages, layers_per_stage
):
    options = dict(dtype="float32", kv_cache_bytes=16 << 20, cache_dir=str(shoal_cache_dir))
    expected = outputs(LLM(five_layer_model, **options), TINY_PROMPTS, GREEDY)
    pipeline = LLM(five_layer_model, pipeline_parallel_size=stages, layers_per_stage=layers_per_stage, **options)
    assert [s.end_layer - s.first_layer for s in pipeline.engine.runner.plan.stages] == list(layers_per_stage or (3, 2))
    assert outputs(pipeline, TINY_PROMPTS, GREEDY) == expected


def test_a_speculating_pipeline_keeps_the_single_process_tokens(five_layer_model, shoal_cache_dir):
    """PP=2, sampled, each request predicting its output (half of them wrongly from the middle on):
    drafts go out with the micro-batches of sequences not in flight and are kept or refused when
    they come back; the tokens are the single process's."""
    options = dict(dtype="float32", kv_cache_bytes=16 << 20, cache_dir=str(shoal_cache_dir))
    single = LLM(five_layer_model, **options)
    try:
        expected = [o.outputs[0].token_ids for o in single.generate(TINY_PROMPTS, SAMPLED)]
    finally:
        single.shutdown()
    predicted = [
        dataclasses.replace(SAMPLED, predicted_token_ids=tuple(ids if i % 2 else ids[:30] + [3] * 30))
        for i, ids in enumerate(expected)
    ]
    pipeline = LLM(five_layer_model, pipeline_parallel_size=2, speculative={"disable_by_batch_size": 64}, **options)
    try:
        assert [o.outputs[0].token_ids for o in pipeline.generate(TINY_PROMPTS, predicted)] == expected
        speculation = pipeline.engine.speculation
        assert 0 < speculation.accepted_draft_tokens < speculation.draft_tokens
    finally:
        pipeline.shutdown()


@pytest.mark.parametrize("variant", ["gemma2", "gemma3"])
def test_gemma_pipelines_give_the_single_process_tokens(variant, shoal_cache_dir, tmp_path):
    """Stages split Gemma's layers: the embedding scale in the first, local and global layers with
    their own RoPE bases across stages, soft-capped logits in the last."""
    config_class, model_class, fields = LAYER_VARIANTS[variant]
    write_random_family_model(tmp_path, config_class, model_class, {**COMMON, **fields})
    options = dict(dtype="float32", kv_cache_bytes=16 << 20, cache_dir=str(shoal_cache_dir))
    expected = outputs(LLM(str(tmp_path), **options), TINY_PROMPTS, GREEDY)
    pipeline = LLM(str(tmp_path), pipeline_parallel_size=2, layers_per_stage=(2, 1), **options)
    assert outputs(pipeline, TINY_PROMPTS, GREEDY) == expected


@pytest.fixture(scope="module")
def smollm2_bfloat16(shoal_cache_dir):
    """The engine options, and the single process's tokens for the text prompts."""
    options = dict(dtype="bfloat16", kv_cache_bytes=32 << 20, cache_dir=str(shoal_cache_dir))
    return options, outputs(LLM("smollm2-135m-instruct", **options), TEXT_PROMPTS, GREEDY)


@pytest.mark.parametrize("stages", [2, 3])
def test_smollm2_pipelines_in_bfloat16_give_the_single_process_tokens(smollm2_bfloat16, stages):
    options, expected = smollm2_bfloat16
    pipeline = LLM("smollm2-135m-instruct", pipeline_parallel_size=stages, **options)
    runner = pipeline.engine.runner
    assert outputs(pipeline, TEXT_PROMPTS, GREEDY) == expected
    if stages == 3:  # the planner's uneven split: the last stage also carries the LM head
        assert [s.end_layer - s.first_layer for s in runner.plan.stages] == [13, 13, 4]
    assert runner.wire_bytes / runner.wire_tokens == 576 * 2  # one 16-bit hidden state per token


@pytest.mark.parametrize(
    "stages,fault,spares",
    [
        ((1,), signal.SIGSTOP, 2),
        ((1, 2), signal.SIGKILL, 0),
    ],
)
def test_a_stage_lost_mid_generation_is_replaced_from_the_boundary_log_and_changes_nothing(
    five_layer_model, shoal_cache_dir, sampled_on_one_process, caplog, stages, fault, spares
):
    """Stage 1 is the middle of three (the head replays to it); stage 2 is replayed to by stage 1.
    Stage 1 hung (SIGSTOP) is found by its missed deadline, and a spare already holding its layers
    takes over. Stages 1 and 2 killed at once are loaded cold: stage 1 is rebuilt first, and its
    rebuilt log then rebuilds stage 2."""
    pipeline = LLM(
        five_layer_model,
        pipeline_parallel_size=3,
        layers_per_stage=(2, 2, 1),
        step_delay_ms=10,
        spare_stages=spares,
        cache_dir=str(shoal_cache_dir),
        **TINY_OPTIONS,
    )
    runner = pipeline.engine.runner
    runner.settings = PipelineSettings(step_deadline_s=2.0, ping_timeout_s=1.0)
    victims = [runner.stages[stage].process for stage in stages]
    at_tokens = []

    def strike() -> None:
        while pipeline.engine.generation_tokens < len(TINY_PROMPTS) * 20:
            time.sleep(0.002)
        at_tokens.append(pipeline.engine.generation_tokens)
        for victim in victims:
            os.kill(victim.pid, fault)

    threading.Thread(target=strike, daemon=True).start()
    with caplog.at_level(logging.WARNING, logger="shoal.parallel.pipeline"):
        assert outputs(pipeline, TINY_PROMPTS, SAMPLED) == sampled_on_one_process
    assert at_tokens and at_tokens[0] < len(TINY_PROMPTS) * 60
    assert runner.replays == len(stages) and all(victim.poll() is not None for victim in victims)
    for stage in stages:
        assert f"pipeline stage {stage} replaced: KV cache rebuilt from the boundary log for 8 sequences" in caplog.text
    assert ("takes over with its layers loaded" in caplog.text) == bool(spares)


@pytest.fixture
def cluster_secret(monkeypatch) -> str:
    """The secret a head (this process) shares with the stage servers it did not start."""
    monkeypatch.setenv(SECRET_ENV, "pipeline-test-secret")
    return "pipeline-test-secret"


@contextlib.contextmanager
def stage_servers(
    cache_dir, *threads: int | None, log_dir=None
) -> Iterator[tuple[list[str], list[subprocess.Popen | ForkedProcess]]]:
    """`shoal stage` servers on loopback (anywhere the head can reach), with these CPU threads and
    this process's cluster secret; server i logs to log_dir/stage-i.log if given."""
    addresses = [f"tcp://127.0.0.1:{free_port()}" for _ in threads]
    processes = []
    for i, (address, count) in enumerate(zip(addresses, threads)):
        log = open(log_dir / f"stage-{i}.log", "wb") if log_dir else subprocess.DEVNULL
        processes.append(
            start_shoal(
                ["stage", "--bind", address] + (["--num-threads", str(count)] if count else []),
                {**os.environ, "SHOAL_CACHE_DIR": str(cache_dir)},
                stderr=log,
            )
        )
    try:
        yield addresses, processes
    finally:
        for process in processes:
            process.kill()
            process.wait()


def test_stages_can_be_stage_servers_that_outlive_their_head(five_layer_model, shoal_cache_dir, cluster_secret):
    """Stage servers take the layers the head assigns, and wait for the next head when this one stops."""
    with stage_servers(shoal_cache_dir, None, None) as (servers, processes):
        options = dict(dtype="float32", kv_cache_bytes=16 << 20, cache_dir=str(shoal_cache_dir))
        expected = outputs(LLM(five_layer_model, **options), TINY_PROMPTS, GREEDY)
        for layers in [(2, 2, 1), (1, 1, 3)]:  # a second head, with another split, after the first stopped
            pipeline = LLM(
                five_layer_model,
                pipeline_parallel_size=3,
                layers_per_stage=layers,
                stage_servers=tuple(servers),
                **options,
            )
            assert [s.process for s in pipeline.engine.runner.stages[1:]] == [None, None]  # started by nobody here
            assert outputs(pipeline, TINY_PROMPTS, GREEDY) == expected
            assert all(process.poll() is None for process in processes)


def test_stage_servers_measure_themselves_and_the_plan_weighs_their_figures(
    five_layer_model, shoal_cache_dir, caplog, cluster_secret
):
    """Probed by the head, each server times a layer with its own threads and reports its free
    memory; the plan is the planner's best split for these figures (servers on one host share its
    memory), and the log shows the figures with the plan."""
    options = dict(dtype="float32", kv_cache_bytes=16 << 20, cache_dir=str(shoal_cache_dir))
    expected = outputs(LLM(five_layer_model, **options), TINY_PROMPTS, GREEDY)
    with (
        stage_servers(shoal_cache_dir, None, 1) as (servers, _),
        caplog.at_level(logging.INFO, logger="shoal.engine.replica"),
    ):
        pipeline = LLM(five_layer_model, pipeline_parallel_size=3, stage_servers=tuple(servers), **options)
        runner = pipeline.engine.runner
        profiles = runner.profiles
        assert [p.device.endswith("CPU threads)") for p in profiles] == [True] * 3
        assert profiles[2].device == "cpu (1 CPU threads)" and all(p.seconds_per_layer > 0 for p in profiles)
        config = pipeline.engine.model.config
        assert runner.plan == plan_stages(config, profiles, ["head", *servers], None, 4, pipeline.engine.max_model_len)
        assert "ms per layer" in caplog.text and servers[1] in caplog.text
        assert outputs(pipeline, TINY_PROMPTS, GREEDY) == expected


def test_a_hung_stage_server_that_wakes_after_its_replacement_cannot_write_stale_slots(
    five_layer_model, shoal_cache_dir, sampled_on_one_process, tmp_path, cluster_secret
):
    """Stage 1, a server SIGSTOPped mid-generation, is replaced; woken up, it forwards the steps
    that waited in its inbox, and stage 2 drops them: they come from a former upstream."""
    with stage_servers(shoal_cache_dir, None, None, log_dir=tmp_path) as (servers, processes):
        pipeline = LLM(
            five_layer_model,
            pipeline_parallel_size=3,
            layers_per_stage=(2, 2, 1),
            step_delay_ms=10,
            stage_servers=tuple(servers),
            cache_dir=str(shoal_cache_dir),
            **TINY_OPTIONS,
        )
        runner = pipeline.engine.runner
        runner.settings = PipelineSettings(step_deadline_s=1.0, ping_timeout_s=0.5)
        hung = processes[0]

        def hang_then_wake() -> None:
            while pipeline.engine.generation_tokens < len(TINY_PROMPTS) * 20:
                time.sleep(0.002)
            hung.send_signal(signal.SIGSTOP)
            while runner.replays == 0:
                time.sleep(0.01)
            hung.send_signal(signal.SIGCONT)

        threading.Thread(target=hang_then_wake, daemon=True).start()
        assert outputs(pipeline, TINY_PROMPTS, SAMPLED) == sampled_on_one_process
        assert runner.replays == 1
        wait_for(lambda: "dropped Step from" in (tmp_path / "stage-1.log").read_text(), timeout_s=30)


def test_with_no_replacement_in_time_the_replica_fails_and_says_so(five_layer_model, shoal_cache_dir):
    """The replacement's address answers nothing (a machine that is gone): after the deadline the
    replica fails as a whole, for the router to move its requests, and its failure hook runs."""
    failures = []
    pipeline = LLM(
        five_layer_model,
        dtype="float32",
        kv_cache_bytes=16 << 20,
        cache_dir=str(shoal_cache_dir),
        pipeline_parallel_size=2,
        step_delay_ms=10,
    )
    engine, runner = pipeline.engine, pipeline.engine.runner
    engine.on_replica_failure = failures.append
    runner.settings = PipelineSettings(step_deadline_s=1.0, ping_timeout_s=0.5, replacement_timeout_s=2.0)
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    links = runner.links
    links.handle = lambda address=None: StageHandle(links.context, links.secret, next(links.idents), address or nowhere)
    runner.stages[1].process.kill()
    try:
        with pytest.raises(ReplicaFailedError, match="stage 1 did not load its layers"):
            pipeline.generate(TINY_PROMPTS, GREEDY)
        assert failures and "stage 1 did not load its layers" in failures[0]
    finally:
        pipeline.shutdown()


def test_shutting_down_while_a_stage_hangs_interrupts_the_wait(five_layer_model, shoal_cache_dir):
    """The engine thread waits on a hung stage (step deadline 30 s); shutdown interrupts that wait,
    fails the request, and stops the stages only once the thread has ended."""
    llm = LLM(
        five_layer_model,
        dtype="float32",
        kv_cache_bytes=16 << 20,
        cache_dir=str(shoal_cache_dir),
        pipeline_parallel_size=2,
        step_delay_ms=10,
    )
    engine = AsyncLLMEngine(lambda: llm.engine)
    stage = llm.engine.runner.stages[1].process

    async def generate_until_the_hang() -> list:
        seen = []
        try:
            async for output in engine.generate(TINY_PROMPTS[0], GREEDY):
                seen.append(output)
                if len(seen) == 5:
                    stage.send_signal(signal.SIGSTOP)
                    threading.Timer(1.0, engine.shutdown).start()
        except RuntimeError as error:
            seen.append(error)
        return seen

    started = time.monotonic()
    seen = asyncio.run(generate_until_the_hang())
    assert isinstance(seen[-1], RuntimeError) and "interrupted" in str(seen[-1])
    wait_for(lambda: stage.poll() is not None, timeout_s=20)  # the hung stage was stopped by shutdown
    assert time.monotonic() - started < 25  # well before the 30 s step deadline
