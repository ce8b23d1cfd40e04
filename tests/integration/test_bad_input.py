"""Bad input raises a typed error for that request alone; the others keep running."""

from __future__ import annotations

import pytest

from shoal.engine.sampling_params import SamplingParams
from shoal.errors import (
    DuplicateRequestError,
    EmptyPromptError,
    InvalidRequestError,
    PromptTooLongError,
)

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def test_errors_are_typed_and_do_not_disturb_running_requests(make_tiny_engine):
    engine = make_tiny_engine(max_model_len=64)
    engine.add_request("good", [5, 6, 7], PARAMS)
    engine.step()
    with pytest.raises(PromptTooLongError):
        engine.add_request("long", list(range(3, 70)), PARAMS)
    with pytest.raises(EmptyPromptError):
        engine.add_request("empty", [], PARAMS)
    with pytest.raises(EmptyPromptError):
        engine.add_request("empty-text", "", PARAMS)
    with pytest.raises(InvalidRequestError):
        engine.add_request("bad-id", [5, 10_000], PARAMS)
    with pytest.raises(DuplicateRequestError):
        engine.add_request("good", [5], PARAMS)
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    engine.check_integrity()
    assert outputs[-1].request_id == "good" and len(outputs[-1].outputs[0].token_ids) == 8


def test_prompt_longer_than_the_kv_cache_is_rejected(make_tiny_engine):
    engine = make_tiny_engine(kv_cache_bytes=8 * 4 * make_tiny_engine().model.kv_bytes_per_block_token())
    with pytest.raises(PromptTooLongError) as info:
        engine.add_request("x", list(range(3, 40)), PARAMS)
    assert info.value.param == "prompt"


def test_abort_frees_blocks_and_reports(make_tiny_engine):
    engine = make_tiny_engine()
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("b", [5, 6, 7], PARAMS)
    engine.step()
    final = engine.abort_request("a")
    assert final.finished and final.outputs[0].finish_reason == "abort"
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_a_sequence_that_outgrows_the_whole_cache_finishes_with_length(make_tiny_engine):
    per_token = make_tiny_engine().model.kv_bytes_per_block_token()
    engine = make_tiny_engine(kv_cache_bytes=8 * 4 * per_token)  # 32 token slots in all
    engine.add_request("big", list(range(3, 13)), SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("small", [5, 6], SamplingParams(max_tokens=4, ignore_eos=True))
    finished = {}
    for _ in range(500):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        engine.check_integrity()
        if not engine.has_unfinished_requests():
            break
    assert set(finished) == {"big", "small"}
    big = finished["big"].outputs[0]
    assert big.finish_reason == "length" and 10 + len(big.token_ids) >= 28
    assert len(finished["small"].outputs[0].token_ids) == 4
