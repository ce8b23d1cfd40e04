"""What holds for Llama holds for every family: a request's tokens (greedy and seeded) do not depend
on its neighbours, the prefix cache or chunked prefill, in bfloat16 on the fused native layer, with
prompts longer than every sliding window; structured output holds its schema, batched or alone."""

from __future__ import annotations

import json

import pytest

from shoal.engine.sampling_params import SamplingParams
from shoal.engine.structured_outputs import StructuredOutputs
from tests.support.engine_runs import (
    alone,
    assert_tokens_ignore_batch_cache_and_chunking,
    engine_factory,
    mixed_prompts,
    run_to_completion,
)
from tests.support.family_variants import COMMON, FAMILIES, LAYER_VARIANTS
from tests.support.tiny_model import write_random_family_model

PARAMS = [
    SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0.9, top_p=0.95, max_tokens=16, seed=5, ignore_eos=True),
]


@pytest.fixture(scope="module", params=FAMILIES)
def family_model(request, tmp_path_factory):
    config_class, model_class, fields = LAYER_VARIANTS[request.param]
    directory = tmp_path_factory.mktemp(request.param)
    write_random_family_model(directory, config_class, model_class, {**COMMON, **fields})
    return directory


def family_engine(model_dir, cache_dir):
    """Engines on a family's model in bfloat16, prefilling at most 32 tokens a step."""
    return engine_factory(model_dir, cache_dir, dtype="bfloat16", max_num_batched_tokens=32)


@pytest.mark.parametrize("params", PARAMS, ids=["greedy", "seeded"])
def test_each_familys_tokens_do_not_depend_on_the_batch_the_cache_or_chunking(family_model, params, shoal_cache_dir):
    assert_tokens_ignore_batch_cache_and_chunking(family_engine(family_model, shoal_cache_dir), params)


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "count": {"type": "integer", "maximum": 99}},
    "required": ["name", "count"],
    "additionalProperties": False,
}


def test_each_familys_structured_output_holds_its_schema_alone_and_batched(family_model, shoal_cache_dir):
    make_engine = family_engine(family_model, shoal_cache_dir)
    structured = SamplingParams(
        temperature=0.8, seed=3, max_tokens=40, structured_outputs=StructuredOutputs(json=json.dumps(SCHEMA))
    )
    prompts = mixed_prompts(4, seed=11, vocab=(3, 98))
    alone_tokens = alone(make_engine, prompts[:1], structured)[0]
    engine = make_engine()
    ids = {f"s{i}": (p, structured) for i, p in enumerate(prompts[:1])}
    ids.update({f"f{i}": (p, PARAMS[1]) for i, p in enumerate(prompts[1:])})
    tokens = run_to_completion(engine, ids)["s0"]
    assert tokens == alone_tokens
    value = json.loads(engine.tokenizer.decode(tokens))
    assert set(value) == {"name", "count"} and isinstance(value["count"], int) and len(value["name"]) <= 6
