"""A worker's counters from its Prometheus `/metrics`, for the benchmarks that read them."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def worker_counters(url: str, names: tuple[str, ...]) -> dict[str, float]:
    """The samples of `url`'s /metrics named in `names`, each summed over its series (0 where absent)."""
    values = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for sample in family.samples:
            if sample.name in values:
                values[sample.name] += sample.value
    return values
