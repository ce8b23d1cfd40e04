"""Engine flags are the EngineConfig's fields: `--speculative` takes its settings as a JSON object,
and bad ones are refused with the reason."""

from __future__ import annotations

import argparse

import pytest

from shoal.config.engine_arguments import add_engine_config_arguments, engine_config_from_arguments
from shoal.config.speculative import SpeculativeConfig


def parse(*argv: str):
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_engine_config_arguments(parser)
    return engine_config_from_arguments(parser.parse_args(argv))


def test_speculative_settings_are_one_json_flag():
    config = parse("--speculative", '{"method": "ngram", "num_speculative_tokens": 2}', "--max-num-seqs", "4")
    assert config.speculative == SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    assert config.max_num_seqs == 4
    assert parse().speculative == SpeculativeConfig()  # no method: only predicted outputs draft


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ('{"method": "ngram"', "is not JSON"),
        ('["ngram"]', "is not a JSON object"),
    ],
)
def test_a_malformed_speculative_flag_is_refused(flag, message):
    with pytest.raises(argparse.ArgumentError, match=message):
        parse("--speculative", flag)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ('{"method": "eagle"}', "speculative method must be ngram or draft_model"),
        ('{"method": "draft_model"}', "a speculative model is given exactly when the method is draft_model"),
        ('{"method": "ngram", "lookahead": 3}', r"unknown speculative config keys: \['lookahead'\]"),
        ('{"method": "ngram", "prompt_lookup_min": 6}', "1 <= prompt_lookup_min <= prompt_lookup_max"),
    ],
)
def test_wrong_speculative_settings_are_refused_with_the_reason(settings, message):
    with pytest.raises(ValueError, match=message):
        parse("--speculative", settings)
