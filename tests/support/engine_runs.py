"""Running an engine's requests to completion (or on from output tokens another engine produced),
checking its invariants every step; the same prompts alone (one fresh engine each) and batched."""

from __future__ import annotations

import random

from shoal.engine.sampling_params import SamplingParams


def engine_factory(model_dir, cache_dir, **defaults):
    """make(**overrides) -> an LLMEngine on `model_dir` on the CPU with a 4 MiB KV cache of 4-token
    blocks, then `defaults`, then the overrides."""
    from shoal.config.engine import EngineConfig
    from shoal.engine.engine import LLMEngine

    def make(**overrides):
        options = dict(
            model=str(model_dir), device="cpu", kv_cache_bytes=4 << 20, block_size=4, cache_dir=str(cache_dir)
        )
        return LLMEngine(EngineConfig(**{**options, **defaults, **overrides}))

    return make


def run_to_completion(engine, requests: dict[str, tuple]) -> dict[str, list[int]]:
    """Adds (prompt, params) or (prompt, params, LoRA adapter) per request id, steps until done,
    checks invariants every step."""
    return {request_id: out.token_ids for request_id, out in final_outputs(engine, requests).items()}


def final_outputs(engine, requests: dict[str, tuple], resume: dict[str, list[int]] | None = None) -> dict:
    """Each request's final CompletionOutput, as run_to_completion runs them, continuing those in
    `resume` from the output tokens given there (first in its token_ids, with empty logprobs)."""
    for request_id, (prompt, params, *lora) in requests.items():
        engine.add_request(
            request_id, prompt, params, resume_token_ids=(resume or {}).get(request_id), lora=lora[0] if lora else None
        )
    results = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0]
        engine.check_integrity()
    return results


def mixed_prompts(count: int, seed: int, vocab=(3, 98)) -> list[list[int]]:
    """`count` random prompts of 1-80 ids from `vocab`, every other one after a shared prefix."""
    rng = random.Random(seed)
    shared = [rng.randrange(*vocab) for _ in range(20)]
    prompts = []
    for i in range(count):
        tail = [rng.randrange(*vocab) for _ in range(rng.randrange(1, 60))]
        # Half the prompts share a 20-token prefix, so later ones hit the prefix cache.
        prompts.append(shared + tail if i % 2 else tail)
    return prompts


def alone(make_engine, prompts, params) -> list[list[int]]:
    """Each prompt's output tokens from an engine of its own, without a prefix cache."""
    results = []
    for i, prompt in enumerate(prompts):
        engine = make_engine(enable_prefix_caching=False)
        results.append(run_to_completion(engine, {f"r{i}": (prompt, params)})[f"r{i}"])
    return results


def batched(engine, prompts, params) -> list[list[int]]:
    """Every prompt's output tokens, all submitted at once to `engine`."""
    results = run_to_completion(engine, {f"r{i}": (p, params) for i, p in enumerate(prompts)})
    return [results[f"r{i}"] for i in range(len(prompts))]


def assert_tokens_ignore_batch_cache_and_chunking(make_engine, params) -> None:
    """Eight mixed prompts, doubled (past a 21-token window), give each the tokens it gets alone
    when batched together, and again when their prefixes come from the cache (which must hit)."""
    prompts = [p + p for p in mixed_prompts(8, seed=9, vocab=(3, 98))]
    expected = alone(make_engine, prompts, params)
    engine = make_engine()
    assert batched(engine, prompts, params) == expected
    hits = engine.stats().prefix_cache_hit_tokens
    assert batched(engine, prompts, params) == expected
    assert engine.stats().prefix_cache_hit_tokens > hits


def _resumed_streams() -> dict[str, tuple[list[int], SamplingParams, int]]:
    """Request id: prompt, params, and the output tokens sent before the stream breaks (the short
    prompt's streams break after more tokens than a 21-token window, the long one's early)."""
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
    seeded = SamplingParams(temperature=1.5, top_p=0.95, max_tokens=32, seed=5, ignore_eos=True, logprobs=0)
    short, long = list(range(10, 19)), [(7 * i) % 90 + 5 for i in range(70)]
    return {
        "short-greedy": (short, greedy, 25),
        "short-seeded": (short, seeded, 25),
        "long-greedy": (long, greedy, 6),
        "long-seeded": (long, seeded, 6),
    }


def assert_streams_resume_token_exact(make_engine) -> None:
    """Streams cut off on one engine and resumed on fresh ones from their tokens so far (recomputing
    their KV, or importing what the first engine computed) give the uninterrupted run's tokens and
    logprobs; the importer computes at most the last block of each (4-token blocks)."""
    streams = _resumed_streams()
    requests = {name: (prompt, params) for name, (prompt, params, _) in streams.items()}

    def continued(outputs: dict) -> dict:
        return {name: (out.token_ids, out.logprobs[streams[name][2] :]) for name, out in outputs.items()}

    expected = continued(final_outputs(make_engine(), requests))
    first = make_engine()
    for request_id, (prompt, params) in requests.items():
        first.add_request(request_id, prompt, params)
    sent: dict[str, list[int]] = {}
    while first.has_unfinished_requests():
        for output in first.step():
            if len(output.outputs[0].token_ids) == streams[output.request_id][2]:
                sent[output.request_id] = output.outputs[0].token_ids
                first.abort_request(output.request_id)
        first.check_integrity()
    assert continued(final_outputs(make_engine(), requests, resume=sent)) == expected
    receiver = make_engine()
    for name, (prompt, _) in requests.items():
        receiver.import_kv(first.export_kv(prompt + sent[name]))
    receiver.reset_counters()
    assert continued(final_outputs(receiver, requests, resume=sent)) == expected
    assert receiver.prompt_tokens_computed <= 4 * len(requests)
