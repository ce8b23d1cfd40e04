"""llama.cpp (`llama-cpp-python` from PyPI, built from source for this CPU) as a peer in the engine
benchmark: its venv, and each measurement as one run of llama_cpp_runs.py on the bundled GGUF.

The build takes 5-8 minutes on 2 cores the first time (PEERS.md); the venv is then reused. Its
default CPU setup (extra buffer types: AMX, repacked weights) crashed on one machine, so a probe in a
child process decides whether the runs use it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from llama_cpp_runs import RESULT_PREFIX
from measurement import measured, token_metrics
from peer_venv import python_of

RUNNER = Path(__file__).resolve().parent / "llama_cpp_runs.py"


def llama_python(log: Callable[[str], None]) -> Path:
    """The llama-cpp venv's python; the first call builds llama.cpp for this CPU (GGML_NATIVE)."""
    return python_of("llama-cpp", log)


def _run(python: Path, request: dict[str, Any]) -> subprocess.CompletedProcess:
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        json.dump(request, file)
        file.flush()
        return subprocess.run(
            [str(python), str(RUNNER), file.name], capture_output=True, text=True, check=False, timeout=1800
        )


def extra_buffers_work(python: Path, gguf_path: Path, threads: int) -> tuple[bool, str]:
    """Whether llama.cpp's default CPU setup decodes here without crashing."""
    done = _run(python, {"mode": "probe", "gguf": str(gguf_path), "threads": threads})
    if done.returncode == 0:
        return True, "default (extra buffer types on)"
    return False, (
        f"default setup exited with {done.returncode} on a 4-token decode (probe in a child process); "
        f"measured with use_extra_bufts=False (no AMX / repacked-weight buffers)"
    )


def bench_llama(
    gguf_path: Path,
    args: argparse.Namespace,
    prompts_for: dict[int, list[list[int]]],
    warm: list[list[int]],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """llama.cpp's single stream (c=1, Llama API) and, unless --no-llama-batched, its parallel
    sequences at every concurrency (batch API): metrics, outputs, setup and version."""
    python = llama_python(log)
    use_extra, note = extra_buffers_work(python, gguf_path, args.threads)
    log(f"  llama.cpp setup: {note}")
    version = None

    def measure(mode: str, prompts: list[list[int]]) -> tuple[dict[str, Any], list[list[int]]]:
        nonlocal version

        def attempt(_: int) -> tuple[dict[str, Any], list[list[int]]]:
            nonlocal version
            request = {
                "mode": mode,
                "gguf": str(gguf_path),
                "threads": args.threads,
                "use_extra_bufts": use_extra,
                "new_tokens": args.new_tokens,
                "warm": warm,
                "prompts": prompts,
            }
            done = _run(python, request)
            lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
            if done.returncode != 0 or not lines:
                raise RuntimeError(f"llama.cpp {mode} run failed ({done.returncode}): {done.stderr[-3000:]}")
            result = json.loads(lines[-1].removeprefix(RESULT_PREFIX))
            version = result["version"]
            m = token_metrics(result["t0"], result["times"], sum(map(len, prompts)))
            m["other_cores"] = result["other_cores"]
            return m, result["outputs"]

        return measured(f"llama.cpp {mode} c={len(prompts)}", attempt, args, log)

    single_m, single_out = measure("single", prompts_for[min(args.concurrency)][:1])
    log(
        f"  llama.cpp Llama API Q4_1 c=1   e2e {single_m['end_to_end_tok_s']:8.1f} tok/s  gen "
        f"{single_m['gen_tok_s']:8.1f} tok/s  ITL p50 {single_m['itl_ms_p50']:7.2f} ms  "
        f"(others: {single_m['other_cores']:.2f} cores)"
    )
    result: dict[str, Any] = {
        "setup": {"use_extra_bufts": use_extra, "note": note},
        "single": {"runs": {1: single_m}, "outputs": {1: single_out}},
    }
    if not args.no_llama_batched:
        batched: dict[str, Any] = {"runs": {}, "outputs": {}}
        for c in args.concurrency:
            m, outs = measure("batched", prompts_for[c])
            batched["runs"][c], batched["outputs"][c] = m, outs
            log(
                f"  llama.cpp batched Q4_1 c={c:<3d} e2e {m['end_to_end_tok_s']:8.1f} tok/s  gen "
                f"{m['gen_tok_s']:8.1f} tok/s  ITL p50 {m['itl_ms_p50']:7.2f} ms  (others: {m['other_cores']:.2f} cores)"
            )
        result["batched"] = batched
    result["version"] = version
    return result
