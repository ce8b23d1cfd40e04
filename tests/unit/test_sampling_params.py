"""Invalid sampling parameters raise a typed error naming the parameter."""

from __future__ import annotations

import pytest

from shoal.engine.sampling_params import SamplingParams
from shoal.errors import InvalidRequestError, InvalidSamplingParamsError


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 2.0),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("logprobs", 21),
        ("stop", ("",)),
        ("stop_token_ids", (-1,)),
        ("min_tokens", 100),
    ],
)
def test_out_of_range_values_are_rejected(field, value):
    with pytest.raises(InvalidSamplingParamsError) as info:
        SamplingParams(**{field: value})
    assert info.value.param == field
    assert isinstance(info.value, InvalidRequestError)


def test_single_stop_string_is_accepted():
    assert SamplingParams(stop="\n").stop == ("\n",)


def test_logit_bias_values_are_in_openais_range():
    assert SamplingParams(logit_bias=[(3, -100), (4, 100)]).logit_bias == ((3, -100.0), (4, 100.0))
    with pytest.raises(InvalidSamplingParamsError) as refused:
        SamplingParams(logit_bias=((3, 101.0),))
    assert refused.value.param == "logit_bias"
