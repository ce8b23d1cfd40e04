"""Router overhead: requests/s and latency each proxy adds on one core, for shoal's router (one
process), vllm-router and SGLang's Model Gateway (`smg`, both Rust), LiteLLM's proxy and nginx as a
plain reverse proxy, all in front of the same trivial upstream, in one run; and shoal as a router
group (`--processes`, default one per CPU) on every CPU, to see it scale with cores.

The upstream is nginx answering a fixed OpenAI chat completion (so it costs next to nothing), or
with --stream-tokens a fixed stream of that many one-token events (a router that follows the tokens,
as shoal's does for failover, reads each; one that passes bytes through does not); with --pace-ms as
well, benchmarks/paced_upstream.py writes each of those events on its own, that far apart, as an
engine does as it generates them (a proxy then reads and writes each one). The
proxy under test runs pinned to CPU 1; the upstream and the load generator share CPU 0 (which the
router group shares with them). Each target
gets wrk (POST with the client key) at 1 and at 32 connections for --seconds each, in --rounds
interleaved rounds (this machine's speed drifts by a fifth over minutes); each figure is the run
with the median requests/s, with its p50 and p99. A ratio between two proxies is the median of
their ratios round by round (each round measures them within a minute of each other, so the drift
cancels). "Added" is a proxy's p50 at one connection minus the upstream's own. Each proxy's CPU time
(user and system, its processes together) per request at 32 connections is the median over rounds:
the hypervisor's stolen time moves requests/s more than it moves CPU per request.

Installs what it needs when missing: nginx-light and wrk (apt); vllm-router, sglang-router and
LiteLLM's proxy from PyPI, each in its own venv (benchmarks/.peers, kept out of the project's).

    .venv/bin/python benchmarks/router_overhead.py [--seconds 8] [--only shoal,vllm-router]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from peer_venv import PEERS, peer_program

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).parent / "results"
COMPLETION = {
    "id": "chatcmpl-bench",
    "object": "chat.completion",
    "created": 0,
    "model": "bench",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
}
REQUEST = {"model": "bench", "messages": [{"role": "user", "content": "Say ok."}], "max_tokens": 1}
# nginx's `return` takes at most 4 KiB: room for about 50 of these events.
STREAM_EVENT = {"id": "c", "choices": [{"index": 0, "delta": {"content": "ok "}}]}
STREAM_END = {"id": "c", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
# Both shoal and LiteLLM check this client key (LiteLLM refuses to start without one).
API_KEY = "sk-router-bench-0123456789abcdef"
HEADERS = {"authorization": f"Bearer {API_KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TARGETS = ("direct", "shoal", "shoal-group", "vllm-router", "smg", "nginx", "litellm")
CONNECTIONS = (1, 32)


def ensure_tools(peers: list[str]) -> dict[str, Path]:
    """Installs nginx and wrk from the system packages if missing; returns each peer's binary, from
    its own venv (peer_venv)."""
    missing = [
        pkg
        for tool, pkg in (("nginx", "nginx-light"), ("wrk", "wrk"))
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists()
    ]
    if missing:
        subprocess.run(["apt-get", "install", "-y", "-q", *missing], check=True, stdout=subprocess.DEVNULL)
    return {name: peer_program(name, print) for name in peers}


def nginx(conf_dir: Path, name: str, server_block: str, cpu: int) -> subprocess.Popen:
    conf = conf_dir / f"{name}.conf"
    conf.write_text(f"""worker_processes 1; daemon off; pid {conf_dir}/{name}.pid; error_log {conf_dir}/{name}.err;
events {{ worker_connections 4096; }}
http {{ access_log off; client_body_temp_path {conf_dir}/{name}-body; proxy_temp_path {conf_dir}/{name}-proxy;
{server_block} }}""")
    nginx_bin = shutil.which("nginx") or "/usr/sbin/nginx"
    return subprocess.Popen(
        ["taskset", "-c", str(cpu), nginx_bin, "-c", str(conf), "-p", str(conf_dir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def pinned(command: list[str], env: dict | None = None, cpus: str = "1") -> subprocess.Popen:
    """A proxy under test, on CPU 1 (a router group: on every CPU)."""
    return subprocess.Popen(
        ["taskset", "-c", cpus, *command],
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def workload(stream_tokens: int) -> tuple[dict, str, str]:
    """The request every client sends, and the upstream's answer to it (content type, body): one
    completion, or with `stream_tokens` a stream of that many one-token events, its end and [DONE]."""
    if not stream_tokens:
        return REQUEST, "application/json", json.dumps(COMPLETION)
    events = [STREAM_EVENT] * stream_tokens + [STREAM_END]
    body = "".join(f"data: {json.dumps(event, separators=(',', ':'))}\n\n" for event in events) + "data: [DONE]\n\n"
    return {**REQUEST, "max_tokens": stream_tokens, "stream": True}, "text/event-stream", body


def wait_up(url: str, process: subprocess.Popen, request: dict, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {process.returncode}")
        try:
            if httpx.post(url + "/v1/chat/completions", json=request, headers=HEADERS, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer")


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds of a process and its living descendants (nginx's workers)."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))
    family, grown = {pid}, True
    while grown:
        children = {child for child, (parent, _) in stats.items() if parent in family} - family
        family |= children
        grown = bool(children)
    return sum(stats[member][1] for member in family if member in stats) / os.sysconf("SC_CLK_TCK")


def wrk(url: str, connections: int, seconds: int, conf_dir: Path, pid: int, request: dict) -> dict:
    """requests/s, p50 and p99 (ms) under `connections` keep-alive connections, and the CPU the
    process `pid` (with its children) spent per request meanwhile; no failed response."""
    script = conf_dir / "post.lua"
    script.write_text(
        f'wrk.method = "POST"\nwrk.body = {json.dumps(json.dumps(request))}\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {API_KEY}"\n'
    )
    cpu_before = cpu_seconds(pid)
    out = subprocess.run(
        [
            "taskset",
            "-c",
            "0",
            "wrk",
            "-t1",
            f"-c{connections}",
            f"-d{seconds}s",
            "--latency",
            "-s",
            str(script),
            url + "/v1/chat/completions",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    cpu_s = cpu_seconds(pid) - cpu_before
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if non_2xx:
        raise RuntimeError(f"{url}: {non_2xx.group(1)} failed responses under load:\n{out}")

    def percentile(label: str) -> float:
        value, unit = re.search(rf"^\s+{label}\s+([\d.]+)(us|ms|s)\s*$", out, re.M).groups()
        return float(value) * {"us": 1e-3, "ms": 1.0, "s": 1e3}[unit]

    return {
        "requests_per_s": float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)),
        "p50_ms": percentile("50%"),
        "p99_ms": percentile("99%"),
        "cpu_us_per_request": 1e6 * cpu_s / int(re.search(r"(\d+) requests in", out).group(1)),
    }


def paired_ratios(ours: list[dict], theirs: list[dict]) -> list[float]:
    """requests/s of one proxy over another's, round by round."""
    return [a["requests_per_s"] / b["requests_per_s"] for a, b in zip(ours, theirs, strict=True)]


def median_run(samples: list[dict]) -> dict:
    """The run with the median requests/s (its latencies with it)."""
    return sorted(samples, key=lambda run: run["requests_per_s"])[len(samples) // 2]


def start_targets(args, binaries: dict[str, Path], conf_dir: Path, processes: list) -> dict[str, tuple[str, int]]:
    """Starts the upstream and every proxy asked for; returns their URLs and process ids by name."""
    upstream_port = free_port()
    request, content_type, body = workload(args.stream_tokens)
    if args.pace_ms:  # each event written on its own, as an engine generates them
        (conf_dir / "answer.sse").write_text(body)
        command = [sys.executable, str(Path(__file__).parent / "paced_upstream.py"), "--port", str(upstream_port)]
        command += ["--body-file", str(conf_dir / "answer.sse"), "--pace-ms", str(args.pace_ms)]
        processes.append(pinned(command, cpus="0"))
    else:
        answer = body.replace("\\", "\\\\").replace("'", "\\'").replace("\n", "\\n")  # an nginx '...' string
        processes.append(
            nginx(
                conf_dir,
                "upstream",
                f"""server {{ listen 127.0.0.1:{upstream_port};
        location = /v1/chat/completions {{ default_type {content_type}; return 200 '{answer}'; }}
        location = /health {{ return 200 ''; }}
        location = /v1/models {{ default_type application/json;
            return 200 '{{"object":"list","data":[{{"id":"bench","object":"model"}}]}}'; }} }}""",
                cpu=0,
            )
        )
    upstream = f"http://127.0.0.1:{upstream_port}"
    wait_up(upstream, processes[-1], request)
    urls = {"direct": (upstream, processes[-1].pid)}
    wanted = set(args.only.split(",")) if args.only else set(TARGETS)
    for name in TARGETS[1:]:
        if name not in wanted:
            continue
        port = free_port()
        if name in ("shoal", "shoal-group"):
            config = conf_dir / f"{name}.yaml"
            tracing = {} if args.trace_sample_ratio is None else {"sample_ratio": args.trace_sample_ratio}
            config.write_text(
                json.dumps(
                    {
                        "workers": [{"url": upstream, "models": ["bench"]}],
                        "api_keys": [{"sha256": hashlib.sha256(API_KEY.encode()).hexdigest()}],
                        "tracing": tracing,
                    }
                )
            )
            command = [sys.executable, "-m", "shoal.cli", "router", "--port", str(port), "--config", str(config)]
            if name == "shoal":
                processes.append(pinned(command))
            else:
                command += ["--processes", str(args.processes)]
                processes.append(pinned(command, cpus=f"0-{os.cpu_count() - 1}"))
        elif name == "vllm-router":
            command = [str(binaries[name]), "--worker-urls", upstream, "--port", str(port), "--policy", "round_robin"]
            command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
            processes.append(pinned(command))
        elif name == "smg":
            command = [
                str(binaries[name]),
                "launch",
                "--worker-urls",
                upstream,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--policy",
                "round_robin",
            ]
            command += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
            processes.append(pinned(command))
        elif name == "nginx":
            processes.append(
                nginx(
                    conf_dir,
                    "proxy",
                    f"""upstream up {{ server 127.0.0.1:{upstream_port}; keepalive 128; }}
        server {{ listen 127.0.0.1:{port}; location / {{ proxy_pass http://up;
            proxy_http_version 1.1; proxy_set_header Connection ""; }} }}""",
                    cpu=1,
                )
            )
        elif name == "litellm":
            config = conf_dir / "litellm.yaml"
            model = {"model": "openai/bench", "api_base": upstream + "/v1", "api_key": "unused"}
            config.write_text(json.dumps({"model_list": [{"model_name": "bench", "litellm_params": model}]}))
            command = [str(binaries[name]), "--config", str(config), "--port", str(port), "--num_workers", "1"]
            env = {"LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR", "LITELLM_MASTER_KEY": API_KEY}
            processes.append(pinned(command, env))
        urls[name] = (f"http://127.0.0.1:{port}", processes[-1].pid)
        wait_up(urls[name][0], processes[-1], request, timeout_s=300)
    return urls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; figures are the median run")
    parser.add_argument(
        "--stream-tokens",
        type=int,
        default=0,
        help="stream this many one-token events a request (at most 50; default: one completion, not streamed)",
    )
    parser.add_argument(
        "--pace-ms",
        type=float,
        default=0.0,
        help="with --stream-tokens: an upstream that writes each event on its own, this far apart "
        "(default 0: nginx, the whole answer in one write)",
    )
    parser.add_argument("--processes", type=int, default=os.cpu_count(), help="members of the shoal-group target")
    parser.add_argument("--only", help=f"comma-separated targets among {', '.join(TARGETS[1:])} (default: all)")
    parser.add_argument(
        "--trace-sample-ratio",
        type=float,
        default=None,
        help="shoal's router.tracing.sample_ratio (default: the router's own default sampling)",
    )
    args = parser.parse_args()
    if not 0 <= args.stream_tokens <= 50:
        parser.error("--stream-tokens: 0 to 50 (the upstream's answer must fit nginx's 4 KiB)")
    if args.pace_ms and not args.stream_tokens:
        parser.error("--pace-ms paces a stream: give --stream-tokens too")
    wanted = args.only.split(",") if args.only else TARGETS[1:]
    binaries = ensure_tools([name for name in wanted if name in PEERS and PEERS[name].program])
    conf_dir = Path(tempfile.mkdtemp(prefix="shoal-router-bench-"))
    processes: list[subprocess.Popen] = []
    try:
        urls = start_targets(args, binaries, conf_dir, processes)
        request = workload(args.stream_tokens)[0]
        runs: dict[str, dict[str, list[dict]]] = {name: {f"c{c}": [] for c in CONNECTIONS} for name in urls}
        for round_number in range(args.rounds):  # interleaved: the machine's speed drifts over minutes
            for name, (url, pid) in urls.items():
                for c in CONNECTIONS:
                    runs[name][f"c{c}"].append(wrk(url, c, args.seconds, conf_dir, pid, request))
            print(f"round {round_number + 1} of {args.rounds} done", flush=True)
        results = {}
        for name in urls:
            results[name] = {key: median_run(samples) for key, samples in runs[name].items()}
            results[name]["runs"] = runs[name]
            cpu_us = results[name]["c32_cpu_us_per_request"] = statistics.median(
                r["cpu_us_per_request"] for r in runs[name]["c32"]
            )
            print(
                f"{name:>12}: "
                + "; ".join(
                    f"c={c} {r['requests_per_s']:,.0f} req/s p50 {r['p50_ms']:.3f} ms p99 {r['p99_ms']:.3f} ms"
                    for c, r in zip(CONNECTIONS, (results[name][f"c{c}"] for c in CONNECTIONS))
                )
                + f"; CPU at c=32 {cpu_us:.0f} µs a request",
                flush=True,
            )
        direct_p50 = results["direct"]["c1"]["p50_ms"]
        for result in results.values():
            result["added_p50_ms_c1"] = result["c1"]["p50_ms"] - direct_p50
        if "shoal" in results:
            for peer in ("vllm-router", "smg", "litellm", "nginx"):
                if peer in results:
                    rounds = paired_ratios(runs["shoal"]["c32"], runs[peer]["c32"])
                    ratio = results["shoal"][f"c32_ratio_to_{peer}"] = statistics.median(rounds)
                    results["shoal"][f"c32_ratios_to_{peer}_by_round"] = rounds
                    print(
                        f"shoal / {peer} requests/s at 32 connections: {ratio:.3f} "
                        f"(rounds: {', '.join(f'{r:.3f}' for r in rounds)})"
                    )
            print(f"shoal adds {results['shoal']['added_p50_ms_c1']:.3f} ms at p50 (one connection)")
            if "shoal-group" in results:
                scale = statistics.median(paired_ratios(runs["shoal-group"]["c32"], runs["shoal"]["c32"]))
                results["shoal-group"]["c32_ratio_to_shoal"] = scale
                print(f"{args.processes} processes on every CPU / one process on one: {scale:.2f}")
        RESULTS.mkdir(exist_ok=True)
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip()
        out = RESULTS / f"router-overhead-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
        out.write_text(json.dumps({"args": vars(args), "commit": commit, "results": results}, indent=2))
        print(f"results: {out}")
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
        shutil.rmtree(conf_dir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
