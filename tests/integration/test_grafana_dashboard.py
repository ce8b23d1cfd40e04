"""The Grafana dashboard in deploy/ reads series that a running router and worker really export."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx

from tests.support.traces import streamed

DASHBOARD = Path(__file__).parents[2] / "deploy" / "grafana" / "shoal-dashboard.json"
SERIES = re.compile(r"\b(shoal[_:][a-z0-9_:]+)")
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum")}


def declared(exposition: str) -> set[str]:
    """Every series name the exposition declares (labelled series appear once they have a value;
    their # TYPE line is there from the start)."""
    names = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            names |= {name, *(name + suffix for suffix in SUFFIXES.get(kind, ()) if not name.endswith(suffix))}
    return names


def test_every_series_the_dashboard_queries_is_exported(traced_fleet):
    url, _, worker, _, _ = traced_fleet
    streamed(url, "00-" + "c" * 32 + "-" + "d" * 16 + "-01")
    exported = declared(httpx.get(url + "/metrics").text + httpx.get(worker + "/metrics").text)
    queries = [target["expr"] for panel in json.loads(DASHBOARD.read_text())["panels"] for target in panel["targets"]]
    queried = {name for query in queries for name in SERIES.findall(query)}
    assert len(queried) > 10
    missing = queried - exported
    assert not missing, missing
