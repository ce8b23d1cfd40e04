"""`shoal serve` runs tensor- and pipeline-parallel replicas: each is several processes on its host
and one worker to the router, and answers as the single-process engine does."""

from __future__ import annotations

import openai
import psutil
import pytest

from shoal.engine.sampling_params import SamplingParams
from shoal.llm import LLM
from tests.support.serving import supervised

MESSAGES = [{"role": "user", "content": "count to ten"}]


@pytest.mark.parametrize(
    "options",
    [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2, "layers_per_stage": [1, 1]}],
    ids=["tensor", "pipeline"],
)
def test_a_multi_process_replica_serves_as_one_worker_with_the_single_process_answer(
    deploy, tiny_model_dir, shoal_cache_dir, options
):
    single = LLM(str(tiny_model_dir), dtype="float32", kv_cache_bytes=8 << 20, cache_dir=str(shoal_cache_dir))
    expected = single.chat(MESSAGES, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))[0].outputs[0].text
    _, url, state_dir, _ = deploy(replicas=1, **options)
    reply = openai.OpenAI(base_url=url + "/v1", api_key="unused").chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].message.content == expected
    [slot] = supervised(state_dir)
    assert len(psutil.Process(slot["pid"]).children()) == 1  # the second rank, or the second stage
