"""Measuring a run: retries while other processes share the CPU, and the throughput and latency
figures computed from per-token timestamps. Shared by the engine benchmark and its peers."""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

from cpu_monitor import wait_for_idle

from shoal.percentile import percentile


def measured(
    label: str, fn: Callable[[int], tuple[dict[str, Any], Any]], args: argparse.Namespace, log: Callable[[str], None]
) -> tuple[dict[str, Any], Any]:
    """Runs fn(attempt); when other processes shared the CPU during it (more than --noise-threshold
    cores), waits for an idle CPU and repeats, up to --retries times. Keeps the least disturbed run."""
    best = None
    attempt = 0
    for attempt in range(args.retries + 1):
        m, extra = fn(attempt)
        if best is None or m["other_cores"] < best[0]["other_cores"]:
            best = (m, extra)
        if m["other_cores"] <= args.noise_threshold or attempt == args.retries:
            break
        log(f"  {label}: other processes used {m['other_cores']:.2f} cores; waiting for an idle CPU and repeating")
        wait_for_idle(args.wait_idle, args.noise_threshold)
    best[0]["attempts"] = attempt + 1
    return best


def token_metrics(t0: float, token_times: list[list[float]], num_prompt_tokens: int) -> dict[str, Any]:
    """Per-request token timestamps (seconds, perf_counter) -> throughput and latency figures.

    end_to_end_tok_s: all output tokens / (last token - submit).
    gen_tok_s: generation phase only: tokens produced after the moment every request had its first
    token, divided by the time from that moment to the last token.
    ITL: gaps between successive tokens of one request, pooled over all requests.
    """
    firsts = [ts[0] for ts in token_times if ts]
    last = max(ts[-1] for ts in token_times if ts)
    total = sum(len(ts) for ts in token_times)
    gen_start = max(firsts)
    gen_tokens = sum(1 for ts in token_times for t in ts if t > gen_start)
    gaps = [(b - a) * 1e3 for ts in token_times for a, b in zip(ts, ts[1:])]
    per_request_mean = [
        statistics.fmean([(b - a) * 1e3 for a, b in zip(ts, ts[1:])]) for ts in token_times if len(ts) > 1
    ]
    ttft = [(t - t0) * 1e3 for t in firsts]
    return {
        "requests": len(token_times),
        "output_tokens": total,
        "prompt_tokens": num_prompt_tokens,
        "wall_s": last - t0,
        "end_to_end_tok_s": total / (last - t0),
        "gen_tok_s": gen_tokens / (last - gen_start) if last > gen_start else float("nan"),
        "ttft_ms_mean": statistics.fmean(ttft),
        "ttft_ms_p50": percentile(ttft, 50),
        "ttft_ms_max": max(ttft),
        "itl_ms_mean": statistics.fmean(gaps) if gaps else float("nan"),
        "itl_ms_p50": percentile(gaps, 50),
        "itl_ms_p90": percentile(gaps, 90),
        "itl_ms_max": max(gaps) if gaps else float("nan"),
        "itl_ms_mean_of_request_means": statistics.fmean(per_request_mean) if per_request_mean else float("nan"),
    }
