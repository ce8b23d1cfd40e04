"""Seeded sampling reproduces alone, batched, after preemption, and resumed in another process."""

from __future__ import annotations

import json
import subprocess
import sys

from shoal.engine.sampling_params import SamplingParams
from tests.support.engine_runs import run_to_completion

PARAMS = SamplingParams(
    temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1, max_tokens=30, seed=1234, ignore_eos=True
)
PROMPT = [5, 17, 22, 40, 41, 42, 9, 9, 9, 60, 61]


def test_same_seed_same_tokens_alone_batched_and_preempted(make_tiny_engine):
    alone = run_to_completion(make_tiny_engine(), {"x": (PROMPT, PARAMS)})["x"]
    others = {
        f"o{i}": ([7 + i] * (5 + 3 * i), SamplingParams(temperature=0.8, max_tokens=30, ignore_eos=True))
        for i in range(8)
    }
    batched = run_to_completion(make_tiny_engine(), {**others, "x": (PROMPT, PARAMS)})["x"]
    tight = make_tiny_engine(kv_cache_bytes=30 * 4 * make_tiny_engine().model.kv_bytes_per_block_token())
    preempted_engine_results = run_to_completion(tight, {**others, "x": (PROMPT, PARAMS)})
    assert tight.stats().num_preemptions > 0
    assert alone == batched == preempted_engine_results["x"]


def test_different_seeds_differ(make_tiny_engine):
    engine = make_tiny_engine()
    a = run_to_completion(engine, {"a": (PROMPT, PARAMS)})["a"]
    b = run_to_completion(engine, {"b": (PROMPT, SamplingParams(**{**PARAMS.__dict__, "seed": 99}))})["b"]
    assert a != b


def test_engine_drawn_seed_is_reported_and_reproduces(make_tiny_engine):
    engine = make_tiny_engine()
    params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)
    engine.add_request("u", PROMPT, params)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    final = outputs[-1]
    replay = run_to_completion(
        make_tiny_engine(), {"v": (PROMPT, SamplingParams(**{**params.__dict__, "seed": final.seed}))}
    )
    assert replay["v"] == final.outputs[0].token_ids


RESUME_SCRIPT = """
import json, sys
from shoal.config.engine import EngineConfig
from shoal.engine.engine import LLMEngine
from shoal.engine.sampling_params import SamplingParams
args = json.loads(sys.argv[1])
engine = LLMEngine(EngineConfig(**args["config"]))
engine.add_request("resumed", args["prompt"], SamplingParams(**args["params"]), resume_token_ids=args["resume"])
new_tokens = []
while engine.has_unfinished_requests():
    for out in engine.step():
        new_tokens += out.new_token_ids
print(json.dumps(new_tokens))
"""


def resume_elsewhere(config: dict, prompt: list[int], params: SamplingParams, resume: list[int]) -> list[int]:
    """Runs the continuation in a fresh Python process; returns the newly generated tokens."""
    fields = {**params.__dict__, "stop": list(params.stop), "stop_token_ids": list(params.stop_token_ids)}
    payload = json.dumps({"config": config, "params": fields, "prompt": prompt, "resume": resume})
    out = subprocess.run(
        [sys.executable, "-c", RESUME_SCRIPT, payload], capture_output=True, text=True, check=True, timeout=300
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _drawn_seeds(engine, count: int) -> list[int]:
    params = SamplingParams(temperature=1.0, max_tokens=1)
    for i in range(count):
        engine.add_request(f"r{i}", PROMPT, params)
    seeds = {}
    while engine.has_unfinished_requests():
        seeds.update({out.request_id: out.seed for out in engine.step()})
    return [seeds[f"r{i}"] for i in range(count)]


def test_replicas_draw_their_own_seeds_unless_the_config_fixes_them(make_tiny_engine):
    """Two replicas left to their default draw different seeds for the same unseeded requests;
    an engine seed makes the draws repeatable."""
    assert _drawn_seeds(make_tiny_engine(), 4) != _drawn_seeds(make_tiny_engine(), 4)
    assert _drawn_seeds(make_tiny_engine(seed=7), 4) == _drawn_seeds(make_tiny_engine(seed=7), 4)


def test_resume_from_prefix_in_another_process(make_tiny_engine, tiny_model_dir, shoal_cache_dir):
    config = dict(
        model=str(tiny_model_dir),
        dtype="float32",
        device="cpu",
        kv_cache_bytes=4 << 20,
        block_size=4,
        cache_dir=str(shoal_cache_dir),
    )
    full = run_to_completion(make_tiny_engine(), {"x": (PROMPT, PARAMS)})["x"]
    cut = 11
    # As a plain prompt: prompt + the output so far, asking for the remaining tokens.
    shorter = SamplingParams(**{**PARAMS.__dict__, "max_tokens": PARAMS.max_tokens - cut})
    assert full[:cut] + resume_elsewhere(config, PROMPT + full[:cut], shorter, []) == full
    # As a resumed request, exact even with output-only penalties.
    penalised = SamplingParams(**{**PARAMS.__dict__, "frequency_penalty": 0.5, "presence_penalty": 0.3})
    full = run_to_completion(make_tiny_engine(), {"y": (PROMPT, penalised)})["y"]
    assert full[:cut] + resume_elsewhere(config, PROMPT, penalised, full[:cut]) == full
