"""Speculative decoding never changes the output: a draft (by prompt lookup, or from a request's
predicted output) is kept exactly when it equals the token the sequence samples itself at that
position, so greedy and seeded requests give the tokens they give without speculation: alone,
batched, and under preemption; rejected drafts' blocks go back (the block counts return to idle)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from shoal.config.speculative import SpeculativeConfig
from shoal.engine.sampling_params import SamplingParams
from shoal.engine.structured_outputs import StructuredOutputs
from tests.support.engine_runs import final_outputs, mixed_prompts, run_to_completion

# Drafting in batches of any size (the engine turns it off above 8 by default, for speed).
# Prompt lookup from two tokens on: a random tiny model repeats itself seldom.
NGRAM = SpeculativeConfig(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, disable_by_batch_size=64)
PARAMS = [
    SamplingParams(temperature=0, max_tokens=40, ignore_eos=True),
    SamplingParams(temperature=0.8, top_p=0.95, max_tokens=40, seed=5, ignore_eos=True, repetition_penalty=1.1),
]


def prompts() -> list[list[int]]:
    """Mixed prompts, and prompts that quote themselves (what prompt lookup drafts from)."""
    quoting = [[7, 8, 9, 10, 11, 12] * 6, [20, 21, 22] * 10 + [20, 21], list(range(30, 60)) * 2]
    return quoting + mixed_prompts(9, seed=4)


def outputs(engine, params: SamplingParams, batched: bool) -> list[list[int]]:
    requests = {f"r{i}": (prompt, params) for i, prompt in enumerate(prompts())}
    if batched:
        done = run_to_completion(engine, requests)
        return [done[f"r{i}"] for i in range(len(requests))]
    return [run_to_completion(engine, {request_id: request})[request_id] for request_id, request in requests.items()]


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_prompt_lookup_keeps_the_output_token_for_token(make_tiny_engine, params, batched):
    expected = outputs(make_tiny_engine(), params, batched)
    engine = make_tiny_engine(speculative=NGRAM)
    idle = engine.block_manager.num_free_blocks
    assert outputs(engine, params, batched) == expected
    assert engine.speculation.draft_tokens > 0  # it did speculate (a random tiny model seldom repeats itself)
    assert engine.block_manager.num_free_blocks == idle  # rejected drafts' blocks came back


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_a_predicted_output_is_drafted_and_kept_where_it_is_right(make_tiny_engine, params):
    """Predictions: exactly the output (every draft kept), the output with wrong tokens in it (kept
    up to each, then found again), and unrelated tokens; batched together, outputs unchanged."""
    expected = outputs(make_tiny_engine(), params, True)
    predictions = []
    for i, output in enumerate(expected):
        wrong = list(output)
        wrong[10] = wrong[25] = (output[10] + 1) % 100
        predictions.append([output, wrong, [3] * 30][i % 3])
    engine = make_tiny_engine(speculative=SpeculativeConfig(disable_by_batch_size=64))  # no method: predictions alone
    idle = engine.block_manager.num_free_blocks
    requests = {
        f"r{i}": (prompt, dataclasses.replace(params, predicted_token_ids=tuple(predictions[i])))
        for i, prompt in enumerate(prompts())
    }
    done = final_outputs(engine, requests)
    assert [done[f"r{i}"].token_ids for i in range(len(requests))] == expected
    assert engine.speculation.accepted_draft_tokens > len(expected) // 3 * 30  # the right predictions were taken
    assert engine.speculation.draft_tokens > engine.speculation.accepted_draft_tokens  # and wrong drafts refused
    # Each request's own count (its usage's accepted and rejected prediction tokens) adds up.
    assert sum(out.kept_drafts for out in done.values()) == engine.speculation.accepted_draft_tokens
    assert (
        sum(out.refused_drafts for out in done.values())
        == engine.speculation.draft_tokens - engine.speculation.accepted_draft_tokens
    )
    assert done["r0"].refused_drafts == 0 and done["r0"].kept_drafts > 0  # the exact prediction: all kept
    assert engine.block_manager.num_free_blocks == idle


@pytest.mark.parametrize(
    ("method", "params"),
    [("ngram", PARAMS[0]), ("prediction", PARAMS[0]), ("prediction", PARAMS[1])],
    ids=["ngram-greedy", "prediction-greedy", "prediction-seeded"],
)
def test_speculation_under_preemption_keeps_the_output(make_tiny_engine, params, method):
    """A cache too small for the batch: sequences are preempted (their blocks, drafts' included,
    given back) and recomputed; every output is unchanged."""
    expected = outputs(make_tiny_engine(), params, True)
    per_token = make_tiny_engine().model.kv_bytes_per_block_token()
    speculative = NGRAM if method == "ngram" else SpeculativeConfig(disable_by_batch_size=64)
    engine = make_tiny_engine(kv_cache_bytes=40 * 4 * per_token, speculative=speculative)
    requests = {
        f"r{i}": (
            prompt,
            dataclasses.replace(params, predicted_token_ids=tuple(expected[i])) if method != "ngram" else params,
        )
        for i, prompt in enumerate(prompts())
    }
    assert run_to_completion(engine, requests) == {f"r{i}": ids for i, ids in enumerate(expected)}
    assert engine.stats().num_preemptions > 0 and engine.speculation.draft_tokens > 0
    assert method == "ngram" or engine.speculation.accepted_draft_tokens > 0  # a right prediction is kept


def test_drafts_follow_the_latest_earlier_occurrence():
    from shoal.engine.ngram_drafter import ngram_draft, predicted_draft

    tokens = [1, 2, 3, 4, 9, 1, 2, 3, 5, 6, 1, 2, 3]
    assert ngram_draft(tokens, 3, 2, 3) == [5, 6, 1]  # "1 2 3" last seen before the end at index 5
    assert ngram_draft(tokens, 1, 2, 3) == [5]
    assert ngram_draft([1, 2, 3, 4], 3, 1, 2) == []  # "4" and "3 4" never occurred before
    assert ngram_draft(tokens, 0, 1, 3) == []
    assert predicted_draft([5, 6, 7, 8, 9], [5, 6], 2, 3) == [7, 8]  # on the prediction's track
    assert predicted_draft([5, 6, 7, 8, 9], [5, 1, 7], 2, 3) == [8, 9]  # off it, then back at "7"
    assert predicted_draft([5, 6, 7], [1, 2], 2, 3) == []


def test_speculation_stands_down_for_large_batches(make_tiny_engine):
    """Above disable_by_batch_size running sequences a step is compute-bound: no drafts."""
    engine = make_tiny_engine(speculative=SpeculativeConfig(method="ngram", disable_by_batch_size=4))
    requests = {f"r{i}": ([20, 21, 22] * 10, PARAMS[0]) for i in range(12)}
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    while engine.has_unfinished_requests() and len(engine.scheduler.running) + len(engine.scheduler.waiting) > 4:
        engine.step()
        assert engine.speculation.draft_tokens == 0


def draft_model(model_dir, **settings) -> SpeculativeConfig:
    return SpeculativeConfig(method="draft_model", model=str(model_dir), disable_by_batch_size=64, **settings)


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
@pytest.mark.parametrize("batched", [False, True], ids=["alone", "batched"])
def test_a_draft_model_keeps_the_output_token_for_token(make_tiny_engine, tiny_draft_model_dir, params, batched):
    """A one-layer draft of the two-layer tiny model: some drafts kept, many refused, outputs unchanged;
    the target's and the draft's blocks all come back."""
    expected = outputs(make_tiny_engine(), params, batched)
    engine = make_tiny_engine(speculative=draft_model(tiny_draft_model_dir))
    drafter = engine.speculation.draft_model.block_manager
    idle, draft_idle = engine.block_manager.num_free_blocks, drafter.num_free_blocks
    assert outputs(engine, params, batched) == expected
    speculation = engine.speculation
    assert 0 < speculation.accepted_draft_tokens < speculation.draft_tokens
    assert engine.block_manager.num_free_blocks == idle
    engine.step()  # the draft model lets go of finished sequences' shadows when it next proposes
    assert drafter.num_free_blocks == draft_idle and not engine.speculation.draft_model.shadows


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_the_target_as_its_own_draft_has_every_draft_kept(make_tiny_engine, tiny_model_dir, params):
    """The draft draws with the request's seed at each position: with the target's own weights every
    draft is the token the target draws, sampled requests too (a draft stops at max_tokens)."""
    expected = outputs(make_tiny_engine(), params, True)
    engine = make_tiny_engine(speculative=draft_model(tiny_model_dir))
    assert outputs(engine, params, True) == expected
    assert engine.speculation.accepted_draft_tokens == engine.speculation.draft_tokens > 0


def test_a_draft_model_under_preemption_keeps_the_output(make_tiny_engine, tiny_draft_model_dir):
    expected = outputs(make_tiny_engine(), PARAMS[1], True)
    per_token = make_tiny_engine().model.kv_bytes_per_block_token()
    engine = make_tiny_engine(kv_cache_bytes=40 * 4 * per_token, speculative=draft_model(tiny_draft_model_dir))
    assert outputs(engine, PARAMS[1], True) == expected
    assert engine.stats().num_preemptions > 0 and engine.speculation.draft_tokens > 0


def test_a_draft_model_with_another_tokenizer_is_refused_by_name(make_tiny_engine):
    from shoal.model.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="draft model smollm2-135m-instruct has another tokenizer"):
        make_tiny_engine(speculative=draft_model("smollm2-135m-instruct"))


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "tags": {"type": "array", "items": {"enum": ["ab", "cd"]}},
    },
    "required": ["name", "tags"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "prediction"])
def test_drafts_under_a_json_schema_keep_the_output(make_tiny_engine, tiny_draft_model_dir, params, method):
    """Under a grammar, drafts (the tokens it forces, else the method's) go only as far as the grammar
    accepts them, each scored under the grammar's mask at its place (the matcher advanced over the
    drafts before it and rolled back): outputs equal the engine's without speculation."""
    grammar = StructuredOutputs(json=json.dumps(SCHEMA))
    constrained = dataclasses.replace(params, structured_outputs=grammar, max_tokens=60)
    requests = {f"r{i}": (prompt, constrained) for i, prompt in enumerate(prompts())}
    expected = run_to_completion(make_tiny_engine(), requests)
    if method == "prediction":
        engine = make_tiny_engine(speculative=SpeculativeConfig(disable_by_batch_size=64))
        requests = {
            r: (prompt, dataclasses.replace(constrained, predicted_token_ids=tuple(expected[r])))
            for r, (prompt, _) in requests.items()
        }
    else:
        settings = {"model": str(tiny_draft_model_dir)} if method == "draft_model" else {}
        engine = make_tiny_engine(speculative=SpeculativeConfig(method=method, disable_by_batch_size=64, **settings))
    idle = engine.block_manager.num_free_blocks
    assert run_to_completion(engine, requests) == expected
    assert engine.speculation.accepted_draft_tokens > 0  # the grammar's forced tokens at least
    assert engine.block_manager.num_free_blocks == idle


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_a_mixed_batch_of_32_keeps_every_output(make_tiny_engine, tiny_draft_model_dir, method):
    """32 requests at once: greedy and seeded, with and without a predicted output (right, half
    right), with and without a json_schema grammar: each one's tokens as without speculation."""
    grammar = StructuredOutputs(json=json.dumps(SCHEMA))
    kinds = [PARAMS[0], PARAMS[1], dataclasses.replace(PARAMS[1], structured_outputs=grammar, max_tokens=60)]
    base = mixed_prompts(32, seed=9)
    requests = {f"r{i}": (prompt, kinds[i % 3]) for i, prompt in enumerate(base)}
    expected = run_to_completion(make_tiny_engine(max_num_seqs=32), requests)
    for i in range(0, 32, 4):  # a prediction for every fourth: the output itself, or its first half
        output = expected[f"r{i}"]
        prediction = output if i % 8 else output[: len(output) // 2] + [3] * 10
        requests[f"r{i}"] = (base[i], dataclasses.replace(kinds[i % 3], predicted_token_ids=tuple(prediction)))
    settings = {"model": str(tiny_draft_model_dir)} if method == "draft_model" else {}
    speculative = SpeculativeConfig(method=method, disable_by_batch_size=64, **settings)
    engine = make_tiny_engine(max_num_seqs=32, speculative=speculative)
    idle = engine.block_manager.num_free_blocks
    assert run_to_completion(engine, requests) == expected
    assert engine.speculation.accepted_draft_tokens > 0
    assert engine.block_manager.num_free_blocks == idle
