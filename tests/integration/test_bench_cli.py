"""`shoal bench` as a user runs it: a subprocess against a real worker serving the tiny model."""

from __future__ import annotations

import json
import os
import re

from tests.support.serving import shoal
from tests.support.workers import MODEL, free_port

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def bench(url: str, *options: str, **kwargs):
    return shoal("bench", "--url", url, "--timeout-s", "60", *options, **kwargs)


def assert_consistent(summary: dict, records: list[dict]) -> None:
    """What every report must satisfy, whatever the timings."""
    assert summary["completed"] + summary["failed"] == summary["total"] == len(records)
    assert summary["completed"] == sum(r["error"] is None for r in records)
    assert summary["completion_tokens"] == sum(r["completion_tokens"] for r in records if r["error"] is None)
    assert summary["goodput"] <= summary["request_throughput"]
    for name in ("ttft_ms", "itl_ms", "e2e_ms"):
        d = summary[name]
        assert d["p50"] <= d["p90"] <= d["p95"] <= d["p99"], name


def test_a_synthetic_run_reports_counts_latencies_goodput_and_plots(worker_url, tmp_path):
    report, plots = tmp_path / "report.json", tmp_path / "plots"
    # No --model: the first one the server lists. Python reports its imports: torch must not be one.
    result = bench(
        worker_url,
        "--requests",
        "12",
        "--prompt-tokens",
        "8",
        "--output-tokens",
        "8",
        "--ignore-eos",
        "--concurrency",
        "4",
        "--slo-ttft-ms",
        "60000",
        "--slo-itl-ms",
        "60000",
        "--output-json",
        str(report),
        "--plot-dir",
        str(plots),
        env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert not re.search(r"\|\s+torch(\.|$)", result.stderr, re.MULTILINE)
    assert "TTFT" in result.stdout and "goodput" in result.stdout

    run = json.loads(report.read_text())
    summary, records = run["summary"], run["requests"]
    assert run["config"]["client"]["model"] == MODEL and run["config"]["arrivals"]["concurrency"] == 4
    assert (summary["total"], summary["completed"], summary["failed"]) == (12, 12, 0)
    assert_consistent(summary, records)
    assert summary["completion_tokens"] == 12 * 8  # ignore_eos: every request ran to max_tokens
    assert summary["request_throughput"] > 0 and summary["output_throughput"] > 0
    assert 0 < summary["good"] <= 12
    assert all(r["ttft_ms"] <= r["e2e_ms"] and r["prompt_tokens"] > 0 for r in records)
    assert sorted(p.name for p in plots.iterdir()) == ["latency_cdf.png", "latency_over_time.png"]
    assert all(p.read_bytes().startswith(PNG_SIGNATURE) for p in plots.iterdir())


def test_a_multi_turn_run_sends_each_turn_after_the_last_with_its_answer(worker_url, tmp_path):
    report = tmp_path / "report.json"
    result = bench(
        worker_url,
        "--model",
        MODEL,
        "--workload",
        "multi-turn",
        "--requests",
        "6",
        "--turns",
        "2",
        "--system-prompt-tokens",
        "8",
        "--prompt-tokens",
        "4",
        "--output-tokens",
        "8",
        "--concurrency",
        "2",
        "--output-json",
        str(report),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    run = json.loads(report.read_text())
    assert_consistent(run["summary"], run["requests"])
    by_turn = {(r["conversation_id"], r["turn"]): r for r in run["requests"]}
    assert sorted(by_turn) == [(c, t) for c in range(3) for t in range(2)]
    for conversation in range(3):
        first, second = by_turn[conversation, 0], by_turn[conversation, 1]
        assert second["start_s"] >= first["start_s"] + first["e2e_ms"] / 1000 - 1e-6
        assert second["prompt_tokens"] > first["prompt_tokens"]


def test_a_server_that_refuses_connections_gives_failed_requests_and_exit_status_1(tmp_path):
    url, report = f"http://127.0.0.1:{free_port()}", tmp_path / "report.json"
    result = bench(url, "--model", MODEL, "--requests", "3", "--output-json", str(report))
    assert result.returncode == 1 and "Traceback" not in result.stderr
    run = json.loads(report.read_text())
    assert (run["summary"]["completed"], run["summary"]["failed"]) == (0, 3)
    assert all(r["status"] is None and "connect" in r["error"].lower() for r in run["requests"])

    result = bench(url, "--requests", "3")  # no --model: the server cannot be asked for one either
    assert result.returncode == 1 and "Traceback" not in result.stderr
    assert "cannot list the models" in result.stderr


def test_bad_options_are_refused_before_anything_is_sent():
    result = bench("http://127.0.0.1:9", "--rate", "0")
    assert result.returncode == 2 and "rate above 0" in result.stderr
