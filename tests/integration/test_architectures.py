"""Logits equal transformers' for each supported architecture variant (tiny random models, float32)."""

from __future__ import annotations

import pytest

from tests.support.family_variants import COMMON, LAYER_VARIANTS, VARIANTS
from tests.support.logits import max_logit_difference
from tests.support.tiny_model import write_random_family_model

# Engine settings a variant runs with.
ENGINE_OPTIONS = {"phi3-longrope-short": {"max_model_len": 128}}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_logits_match_transformers(variant, tmp_path, shoal_cache_dir):
    assert logit_difference(VARIANTS[variant], tmp_path, shoal_cache_dir) <= 1e-3


@pytest.mark.parametrize("kernel", ["rows", "tiles"])
@pytest.mark.parametrize("variant", sorted(LAYER_VARIANTS))
def test_layer_variants_match_transformers_on_both_paths(variant, kernel, tmp_path, shoal_cache_dir):
    paths = []

    def record_paths(llm) -> None:
        paths.extend("native" if layer.native is not None else "torch" for layer in llm.engine.model.layers)

    options = ENGINE_OPTIONS.get(variant, {})
    assert logit_difference(LAYER_VARIANTS[variant], tmp_path, shoal_cache_dir, kernel, record_paths, **options) <= 1e-3
    # The rows kernel comes with the fused native layer, for every variant; the tiles kernel with
    # the torch layer.
    assert set(paths) == {"native" if kernel == "rows" else "torch"}


def logit_difference(variant: tuple, directory, cache_dir, kernel: str = "auto", inspect=None, **options) -> float:
    """The largest logit difference from transformers over a 120-token prompt, for a tiny random
    model of `variant` (config class, model class, config fields)."""
    config_class, model_class, extra = variant
    reference = write_random_family_model(directory, config_class, model_class, {**COMMON, **extra})
    return max_logit_difference(reference, directory, cache_dir, list(range(3, 123)), kernel, inspect, **options)
