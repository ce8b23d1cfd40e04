"""Simulation against reality: one workload on a real 3-worker cluster and on its simulation.

1. `shoal serve` with one replica: that worker calibrates alone (the figures are cached, keyed by
   everything they depend on), then stops.
2. `shoal serve` with three replicas and the same settings (so they reuse those figures) on this
   machine: the three workers share its cores.
3. Probes on the idle cluster measure what the start-up calibration leaves out (see `probe`): the
   time a request spends outside the engine, and how much three workers decoding at once slow each
   other down.
4. Per load point, a warm-up workload (another seed, the same shape and load) runs through the
   router while the workers' /load reports are read every half second: the speeds they measure
   while serving side by side (`WorkerFigures.from_report`), averaged.
5. The measured workload runs through the router (`shoal bench`'s runner); the workers' prefix
   cache counters and engine-side time-to-first-token sums are read before and after.
6. The same workload is simulated twice, with the router's policy and the probed request overhead:
   `a priori`, from the start-up calibration, the workers sharing a host whose cores are the probed
   effective ones; and `live`, from the speeds
   measured in the warm-up (contention included, so each worker has a host of its own).

Printed and saved (benchmarks/results/sim-validation-*.json, per-request records included): mean and
p50/p99 time to first token, end-to-end latency, output and request throughput and the prefix cache
hit rate, real and simulated, with the ratios; the cores used by the workers, the router, this
client and other processes during each measured run.

    .venv/bin/python benchmarks/sim_validation.py [--loads poisson:0.6,closed:6] [--requests 45]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import httpx
import psutil
import yaml
from worker_metrics import worker_counters

from shoal.bench.arrivals import ArrivalProcess
from shoal.bench.client import ChatClient, ClientSettings
from shoal.bench.lengths import parse_length
from shoal.bench.runner import run_workload
from shoal.bench.stats import summarize
from shoal.bench.workloads import WorkloadConfig, build_workload
from shoal.simulate.calibration import WorkerFigures, average
from shoal.simulate.cost_model import CalibrationFigures
from shoal.simulate.fleet import FleetSpec, WorkerClass
from shoal.simulate.router import RouterSettings
from shoal.simulate.simulation import SimulationConfig, simulate

RESULTS = Path(__file__).parent / "results"
MODEL = "smollm2-135m-instruct"
REPORT_INTERVAL_S = 0.5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_config(directory: Path, replicas: int, args: argparse.Namespace) -> Path:
    path = directory / f"serve-{replicas}.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "host": "127.0.0.1",
                "port": free_port(),
                "state_dir": str(directory / f"state-{replicas}"),
                "router": {"policy": args.policy},
                "models": [
                    {
                        "name": MODEL,
                        "model": MODEL,
                        "replicas": replicas,
                        "dtype": args.dtype,
                        "kv_cache": args.kv_cache,
                        "num_threads": args.threads_per_worker,
                    }
                ],
            }
        )
    )
    return path


class Serve:
    """`shoal serve --config` as a subprocess, stopped (workers too) on exit."""

    def __init__(self, config: Path, env: dict[str, str]):
        self.config, self.env = config, env
        self.log = config.with_suffix(".log")

    def __enter__(self) -> Serve:
        raw = yaml.safe_load(self.config.read_text())
        replicas = raw["models"][0]["replicas"]
        with open(self.log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "shoal.cli", "serve", "--config", str(self.config)],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 600
        while f"ready: {replicas} workers serving" not in self.log.read_text():
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.__exit__()
                raise RuntimeError(f"shoal serve did not get ready; see {self.log}")
            time.sleep(0.5)
        self.url = f"http://127.0.0.1:{raw['port']}"
        slots = json.loads((Path(raw["state_dir"]) / "serve" / "workers.json").read_text())
        self.workers = [slot["url"] for slot in slots if slot["state"] == "serving"]
        return self

    def __exit__(self, *exc) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def cpu_seconds(self) -> tuple[float, float]:
        """CPU time of the router (the serve process itself) and of the workers (its children)."""
        try:
            root = psutil.Process(self.process.pid)
            return _cpu(root), sum(_cpu(child) for child in root.children(recursive=True))
        except psutil.NoSuchProcess:
            return 0.0, 0.0


def _cpu(process: psutil.Process) -> float:
    try:
        times = process.cpu_times()
        return times.user + times.system
    except psutil.NoSuchProcess:
        return 0.0


def machine_busy_seconds() -> float:
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def own_cpu_seconds() -> float:
    times = psutil.Process().cpu_times()
    return times.user + times.system


def wait_for_idle(max_wait_s: float, threshold_cores: float = 0.2, exclude: Serve | None = None) -> float:
    """Waits until processes other than this one (and `exclude`'s) use under threshold_cores, or
    max_wait_s passes; returns the last figure."""
    deadline = time.monotonic() + max_wait_s
    while True:

        def ours() -> float:
            return own_cpu_seconds() + (sum(exclude.cpu_seconds()) if exclude else 0.0)

        busy, own, started = machine_busy_seconds(), ours(), time.monotonic()
        time.sleep(2.0)
        other = (machine_busy_seconds() - busy - (ours() - own)) / (time.monotonic() - started)
        if other < threshold_cores or time.monotonic() > deadline:
            return other
        print(f"  waiting for an idle CPU: other processes use {other:.2f} cores", flush=True)


COUNTERS = (
    "shoal:prefix_cache_hits_total",
    "shoal:prefix_cache_queries_total",
    "shoal:time_to_first_token_seconds_sum",
    "shoal:time_to_first_token_seconds_count",
)


def fleet_counters(workers: list[str]) -> dict[str, float]:
    """The workers' prefix cache counters and engine-side time-to-first-token sums, added up."""
    each = [worker_counters(url, COUNTERS) for url in workers]
    return {name: sum(counters[name] for counters in each) for name in COUNTERS}


async def send(requests, serve: Serve, concurrency: int | None) -> tuple[list, float, list[WorkerFigures]]:
    """Runs the requests through the router, reading every worker's /load each REPORT_INTERVAL_S."""
    samples: list[WorkerFigures] = []

    async def sample(session: aiohttp.ClientSession) -> None:
        while True:
            await asyncio.sleep(REPORT_INTERVAL_S)
            for url in serve.workers:
                async with session.get(url + "/load") as response:
                    samples.append(WorkerFigures.from_report(await response.json(), url))

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        sampler = asyncio.create_task(sample(session))
        client = ChatClient(session, ClientSettings(url=serve.url, model=MODEL, ignore_eos=True, timeout_s=600))
        result = await run_workload(requests, client, concurrency)
        sampler.cancel()
    return result.records, result.duration_s, samples


PROBE_WORDS = (
    "the of and to in is it you that he was for on are as with his they at be this have from or "
    "one had by word but not what all were we when your can said there use an each"
).split()


async def timed(session: aiohttp.ClientSession, url: str, words: int, max_tokens: int, seed: int) -> list[float]:
    """Sends one streamed chat completion of `words` random words; the arrival time of every token
    (from the send, in seconds)."""
    rng = random.Random(seed)
    body = {
        "model": MODEL,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "temperature": 0,
        "messages": [{"role": "user", "content": " ".join(rng.choice(PROBE_WORDS) for _ in range(words))}],
    }
    started, times = time.perf_counter(), []
    async with session.post(url + "/v1/chat/completions", json=body) as response:
        async for line in response.content:
            if line.startswith(b"data: {"):
                choices = json.loads(line[6:]).get("choices") or [{}]
                times += [time.perf_counter() - started] * len(choices[0].get("token_ids") or ())
    return times


def engine_ttft_s(worker: str) -> float:
    counted = fleet_counters([worker])
    return counted["shoal:time_to_first_token_seconds_sum"]


async def probe(serve: Serve) -> dict:
    """Measures, on the idle cluster, what the start-up calibration leaves out: how long a request
    spends outside the engine (time to first token through the router minus the engine's own, for
    requests sent one after another) and how much the workers slow each other down (inter-token
    latency of three workers decoding at once over that of one alone). Returns the figures and the
    probes' raw timings."""
    worker, seed = serve.workers[0], iter(range(10_000, 20_000))
    async with aiohttp.ClientSession() as session:

        async def engine_side(url: str) -> tuple[float, float]:
            before = sum(engine_ttft_s(w) for w in serve.workers)
            times = await timed(session, url, 200, 2, next(seed))
            return sum(engine_ttft_s(w) for w in serve.workers) - before, times[0]

        routed = [await engine_side(serve.url) for _ in range(5)][1:]  # the first one warms up
        alone = await timed(session, worker, 20, 48, next(seed))
        together = await asyncio.gather(*(timed(session, w, 20, 48, next(seed)) for w in serve.workers))

    def mean(values) -> float:
        return sum(values) / len(values)

    def itl(times: list[float]) -> float:
        return (times[-1] - times[0]) / (len(times) - 1)

    slowdown = mean([itl(t) for t in together]) / itl(alone)
    return {
        "request_overhead_s": max(0.0, mean([client - engine for engine, client in routed])),
        "contention_slowdown": slowdown,
        "effective_cores": len(serve.workers) / max(1.0, slowdown),
        "raw": {"routed": routed, "itl_alone_s": itl(alone), "itl_together_s": [itl(t) for t in together]},
    }


def simulated(
    workload: WorkloadConfig,
    arrivals: ArrivalProcess,
    figures: WorkerFigures,
    workers: int,
    per_host: int,
    cores: float,
    overhead_s: float,
    args: argparse.Namespace,
):
    """The same workload over `workers` workers, `per_host` of them sharing a host of `cores` cores."""
    worker_class = WorkerClass(
        "cpu",
        1.0,
        kv=figures.kv_tokens,
        seqs=figures.max_num_seqs,
        threads=args.threads_per_worker,
        per_host=per_host,
        cores=cores,
    )
    config = SimulationConfig(
        FleetSpec(workers, (worker_class,)),
        workload,
        arrivals,
        RouterSettings(policy=args.policy, report_interval_s=REPORT_INTERVAL_S),
        figures,
        request_overhead_s=overhead_s,
    )
    return config, simulate(config)


def compared(summary, hit_rate: float) -> dict:
    """The compared figures of a bench Summary or a simulated SimSummary."""
    return {
        "ttft_mean_ms": summary.ttft_ms.mean,
        "ttft_p50_ms": summary.ttft_ms.p50,
        "ttft_p99_ms": summary.ttft_ms.p99,
        "e2e_mean_ms": summary.e2e_ms.mean,
        "output_tokens_per_s": summary.output_throughput,
        "requests_per_s": summary.request_throughput,
        "duration_s": summary.duration_s,
        "prefix_cache_hit_rate": hit_rate,
    }


def measure(
    serve: Serve,
    workload: WorkloadConfig,
    arrivals: ArrivalProcess,
    startup: WorkerFigures,
    probed: dict,
    args: argparse.Namespace,
) -> dict:
    warmup = dataclasses.replace(workload, seed=workload.seed + 50)
    _, _, samples = asyncio.run(send(build_workload(warmup, arrivals), serve, arrivals.concurrency))
    live = dataclasses.replace(average(samples), source=f"{len(samples)} /load reports during the warm-up")

    before = fleet_counters(serve.workers)
    busy, (router, workers), own, started = (
        machine_busy_seconds(),
        serve.cpu_seconds(),
        own_cpu_seconds(),
        time.monotonic(),
    )
    records, duration, _ = asyncio.run(send(build_workload(workload, arrivals), serve, arrivals.concurrency))
    elapsed = time.monotonic() - started
    (router_after, workers_after), own_after = serve.cpu_seconds(), own_cpu_seconds()
    usage = {
        "workers": (workers_after - workers) / elapsed,
        "router": (router_after - router) / elapsed,
        "client": (own_after - own) / elapsed,
    }
    usage["others"] = (machine_busy_seconds() - busy) / elapsed - sum(usage.values())
    counted = {name: value - before[name] for name, value in fleet_counters(serve.workers).items()}
    real = summarize(records, duration)

    count, overhead_s = len(serve.workers), probed["request_overhead_s"]
    runs = {
        "a_priori": simulated(workload, arrivals, startup, count, count, probed["effective_cores"], overhead_s, args),
        "live": simulated(workload, arrivals, live, count, 1, args.threads_per_worker, overhead_s, args),
    }
    hit_rate = counted["shoal:prefix_cache_hits_total"] / max(1.0, counted["shoal:prefix_cache_queries_total"])
    engine_ttft_ms = (
        1000
        * counted["shoal:time_to_first_token_seconds_sum"]
        / max(1.0, counted["shoal:time_to_first_token_seconds_count"])
    )
    figures = {
        "real": compared(real, hit_rate),
        **{variant: compared(run.summary, run.summary.cache_hit_rate) for variant, (_, run) in runs.items()},
    }
    return {
        "arrivals": dataclasses.asdict(arrivals),
        "cpu_cores_used": usage,
        "engine_ttft_mean_ms": engine_ttft_ms,
        "live_calibration": live.calibration.as_dict(),
        "completed": real.completed,
        "failed": real.failed,
        "errors": real.errors,
        "figures": figures,
        "simulations": {variant: config.as_dict() for variant, (config, _) in runs.items()},
        "requests": {
            "real": [r.as_dict() for r in records],
            **{variant: [dataclasses.asdict(o) for o in run.outcomes] for variant, (_, run) in runs.items()},
        },
    }


def print_result(load: str, result: dict) -> None:
    usage = ", ".join(f"{k} {v:.2f}" for k, v in result["cpu_cores_used"].items())
    print(
        f"{load}: {result['completed']} completed, {result['failed']} failed; cores used: {usage}; mean TTFT "
        f"inside the workers' engines {result['engine_ttft_mean_ms']:.0f} ms; live calibration "
        f"{result['live_calibration']}",
        flush=True,
    )
    figures = result["figures"]
    print(f"{'':>22} {'real':>9} {'a priori':>9} {'ratio':>6} {'live':>9} {'ratio':>6}")
    for name, real in figures["real"].items():
        cells = [f"{real:>9.2f}"]
        for variant in ("a_priori", "live"):
            value = figures[variant][name]
            cells += [f"{value:>9.2f}", f"{value / real:>6.2f}" if real else f"{'-':>6}"]
        print(f"{name:>22} {' '.join(cells)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--loads",
        default="poisson:0.6,closed:6",
        help="load points: poisson:RATE (requests/s) or closed:CONCURRENCY, comma-separated",
    )
    parser.add_argument("--requests", type=int, default=45)
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--prompt-tokens", default="32:160")
    parser.add_argument("--output-tokens", default="16:64")
    parser.add_argument("--system-prompt-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--policy", default="cost")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--kv-cache", default="256MiB")
    parser.add_argument(
        "--wait-idle-s",
        type=float,
        default=60.0,
        help="before calibrating and before each load point, wait up to this long for other processes to go quiet",
    )
    parser.add_argument(
        "--cluster-src",
        default=None,
        help="run the cluster from this source tree (PYTHONPATH), e.g. a `git archive` export",
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="SHOAL_CACHE_DIR for the workers (default: a fresh temporary one, so the calibration is measured here)",
    )
    args = parser.parse_args()
    started = time.monotonic()
    directory = Path(tempfile.mkdtemp(prefix="shoal-sim-validation-"))
    env = {**os.environ, "SHOAL_CACHE_DIR": args.cache_dir or str(directory / "cache")}
    if args.cluster_src:
        env["PYTHONPATH"] = args.cluster_src

    print(f"idle check: other processes use {wait_for_idle(args.wait_idle_s):.2f} cores", flush=True)
    with Serve(serve_config(directory, 1, args), env) as alone:
        alone_report = httpx.get(alone.workers[0] + "/load", timeout=10).json()
    print(f"calibrated alone: {alone_report['calibration']}", flush=True)

    results = []
    with Serve(serve_config(directory, 3, args), env) as cluster:
        reports = [httpx.get(url + "/load", timeout=10).json() for url in cluster.workers]
        startup = dataclasses.replace(
            WorkerFigures.from_report(reports[0], "the start-up calibration"),
            calibration=CalibrationFigures.from_dict(reports[0]["calibration"]),
        )
        if len({CalibrationFigures.from_dict(r["calibration"]) for r in reports}) > 1:
            print("warning: the workers report different calibrations; the first one's is used", flush=True)
        print(
            f"probing the idle cluster (idle check: {wait_for_idle(args.wait_idle_s, exclude=cluster):.2f} cores "
            "used by others)",
            flush=True,
        )
        probed = asyncio.run(probe(cluster))
        print("probed: " + ", ".join(f"{k} {v:.3f}" for k, v in probed.items() if k != "raw"), flush=True)
        for index, load in enumerate(args.loads.split(",")):
            kind, _, value = load.partition(":")
            arrivals = (
                ArrivalProcess("poisson", float(value))
                if kind == "poisson"
                else ArrivalProcess("closed", concurrency=int(value))
            )
            workload = WorkloadConfig(
                "multi-turn",
                args.requests,
                parse_length(args.prompt_tokens),
                parse_length(args.output_tokens),
                args.system_prompt_tokens,
                args.turns,
                seed=args.seed + 100 * index,
            )  # each load point has requests of its own
            other = wait_for_idle(args.wait_idle_s, exclude=cluster)
            print(f"\n{load}: idle check: other processes use {other:.2f} cores", flush=True)
            result = measure(cluster, workload, arrivals, startup, probed, args)
            results.append({"load": load, **result})
            print_result(load, result)

    RESULTS.mkdir(exist_ok=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = RESULTS / f"sim-validation-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "commit": commit,
                "calibrated_alone": alone_report["calibration"],
                "probed": probed,
                "wall_s": time.monotonic() - started,
                "results": results,
            },
            indent=1,
        )
    )
    shutil.rmtree(directory)  # the workers' cache holds converted weights (a failed run keeps it, with the logs)
    print(f"\nresults: {out} ({time.monotonic() - started:.0f} s)")
    for variant in ("a_priori", "live"):
        ratios = [
            r["figures"][variant][k] / r["figures"]["real"][k]
            for r in results
            for k in ("ttft_mean_ms", "output_tokens_per_s")
        ]
        verdict = "yes" if all(abs(ratio - 1) <= 0.25 for ratio in ratios) else "no"
        print(f"{variant}: mean TTFT and output throughput within 25% at every load: {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
