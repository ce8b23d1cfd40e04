"""`shoal simulate` as a user runs it: a subprocess on small inputs, its JSON checked for consistency."""

from __future__ import annotations

import json
import subprocess
import sys


def shoal(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shoal.cli", *args], capture_output=True, text=True, timeout=120)


def test_simulate_compares_policies_and_writes_a_consistent_report(tmp_path):
    report, plot = tmp_path / "sim.json", tmp_path / "sim.png"
    result = shoal(
        "simulate",
        "--workers",
        "4",
        "--mix",
        "fast:1:speed=2;slow:3:kv=8192,mtbf=20,repair=5",
        "--policies",
        "round_robin,cost",
        "--workload",
        "multi-turn",
        "--requests",
        "24",
        "--prompt-tokens",
        "16:64",
        "--output-tokens",
        "8:32",
        "--rate",
        "3",
        "--seed",
        "3",
        "--ttft-target-ms",
        "400",
        "--tpot-target-ms",
        "200",
        "--sheddable-share",
        "0.5",
        "--output-json",
        str(report),
        "--plot",
        str(plot),
    )
    assert result.returncode == 0, result.stderr
    assert "round_robin" in result.stdout and "cost" in result.stdout
    assert "latency targets: TTFT 400 ms, TPOT 200 ms" in result.stdout and "goodput" in result.stdout
    body = json.loads(report.read_text())
    assert body["config"]["fleet"]["counts"] == {"fast": 1, "slow": 3}
    assert body["config"]["workload"]["requests"] == 24
    assert set(body["results"]) == {"round_robin", "cost"}
    for entry in body["results"].values():
        summary, requests = entry["summary"], entry["requests"]
        assert summary["completed"] + summary["failed"] == summary["total"] == len(requests) == 24
        assert summary["completed"] == sum(r["error"] is None for r in requests)
        ttft = summary["ttft_ms"]
        assert ttft["p50"] <= ttft["p90"] <= ttft["p95"] <= ttft["p99"]
        assert summary["migrations"] == sum(r["migrations"] for r in requests)
        assert 0 <= summary["cache_hit_rate"] <= 1
        assert summary["with_targets"] == 24 and summary["met_targets"] == sum(bool(r["met_targets"]) for r in requests)
    assert plot.read_bytes().startswith(b"\x89PNG")


def test_policies_run_in_parallel_give_the_same_figures(tmp_path):
    outputs = []
    for jobs in ("1", "2"):
        report = tmp_path / f"sim-{jobs}.json"
        result = shoal(
            "simulate",
            "--workers",
            "3",
            "--policies",
            "power_of_two,cache_aware",
            "--requests",
            "12",
            "--prompt-tokens",
            "32",
            "--output-tokens",
            "8",
            "--concurrency",
            "3",
            "--jobs",
            jobs,
            "--summary-only",
            "--output-json",
            str(report),
        )
        assert result.returncode == 0, result.stderr
        outputs.append({p: e["summary"] for p, e in json.loads(report.read_text())["results"].items()})
        assert all("requests" not in e for e in json.loads(report.read_text())["results"].values())
    assert outputs[0] == outputs[1]


def test_bad_options_are_refused_with_the_reason():
    result = shoal("simulate", "--workers", "3", "--mix", "a:1:colour=red")
    assert result.returncode == 2 and "unknown worker class keys" in result.stderr
    result = shoal("simulate", "--policies", "fastest")
    assert result.returncode == 2 and "unknown policies" in result.stderr
    result = shoal("simulate", "--sheddable-share", "2")
    assert result.returncode == 2 and "--sheddable-share must be from 0 to 1" in result.stderr
    result = shoal("simulate", "--calibrate-from", "/nonexistent.json")
    assert result.returncode == 2 and "nonexistent" in result.stderr


def test_the_simulator_loads_without_torch():
    code = (
        "import sys, shoal.cli, shoal.simulate.command, shoal.simulate.simulation, shoal.simulate.plots; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
