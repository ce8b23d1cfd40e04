"""Sizes and KV budgets are parsed in one place: a bare number is a fraction, a size has a unit."""

from __future__ import annotations

import pytest

from shoal.sizes import parse_kv_cache


@pytest.mark.parametrize(
    "value,expected",
    [
        ("0.3", {"kv_cache_fraction": 0.3}),
        (0.5, {"kv_cache_fraction": 0.5}),
        (1.0, {"kv_cache_fraction": 1.0}),
        ("1.0", {"kv_cache_fraction": 1.0}),
        (1, {"kv_cache_fraction": 1.0}),
        ("512MiB", {"kv_cache_bytes": 512 << 20}),
        ("2GB", {"kv_cache_bytes": 2 * 10**9}),
        ("1048576B", {"kv_cache_bytes": 1 << 20}),
        ("1.5GiB", {"kv_cache_bytes": 3 << 29}),
        ("2 GiB", {"kv_cache_bytes": 2 << 30}),
        ("1TB", {"kv_cache_bytes": 10**12}),
        ("1tib", {"kv_cache_bytes": 1 << 40}),
    ],
)
def test_kv_cache_budgets_are_fractions_or_sizes(value, expected):
    assert parse_kv_cache(value) == expected


@pytest.mark.parametrize("value", ["lots", "-1", "0", 0, "1048576", 2, 1.5, "12 parsecs", True, "0B", None])
def test_a_kv_cache_budget_that_is_neither_is_refused_with_the_reason(value):
    with pytest.raises(ValueError, match="fraction|size|empty"):
        parse_kv_cache(value)
