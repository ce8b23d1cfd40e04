"""Router overhead: latency the proxy adds and the requests/s it relays on one core, for shoal's
router, nginx as a plain reverse proxy and LiteLLM's proxy, all in front of the same trivial upstream.

The upstream is nginx answering a fixed OpenAI chat completion (so it costs next to nothing). The
proxy under test runs pinned to CPU 1; the upstream and the load generators share CPU 0. Latency:
sequential requests over one keep-alive connection (httpx), p50 and p99, minus the same figures
measured directly against the upstream. Throughput: wrk, 64 connections, POST, for --seconds.

Installs what it needs when missing: nginx-light and wrk (apt), LiteLLM's proxy in its own venv
(.venv-litellm, kept out of the project's environment).

    .venv/bin/python benchmarks/router_overhead.py [--requests 2000] [--seconds 10]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from peer_venv import peer_python

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
# Both shoal and LiteLLM check this client key (LiteLLM refuses to start without one).
API_KEY = "sk-router-bench-0123456789abcdef"
HEADERS = {"authorization": f"Bearer {API_KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ensure_tools() -> Path:
    """Installs nginx and wrk from the system packages if missing; returns LiteLLM's proxy binary,
    from its own venv (peer_venv)."""
    missing = [
        pkg
        for tool, pkg in (("nginx", "nginx-light"), ("wrk", "wrk"))
        if not shutil.which(tool) and not Path(f"/usr/sbin/{tool}").exists()
    ]
    if missing:
        subprocess.run(["apt-get", "install", "-y", "-q", *missing], check=True, stdout=subprocess.DEVNULL)
    return peer_python("litellm", ["litellm[proxy]"], print).parent / "litellm"


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


def wait_up(url: str, process: subprocess.Popen, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{url}: process exited with {process.returncode}")
        try:
            if httpx.post(url + "/v1/chat/completions", json=REQUEST, headers=HEADERS, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{url} did not answer")


def latency(url: str, requests: int) -> dict:
    samples = []
    with httpx.Client(base_url=url, timeout=30, headers=HEADERS) as client:
        for i in range(requests + 200):
            started = time.perf_counter()
            response = client.post("/v1/chat/completions", json=REQUEST)
            elapsed = time.perf_counter() - started
            assert response.status_code == 200, response.text
            if i >= 200:
                samples.append(elapsed)
    samples.sort()
    return {"p50_ms": samples[len(samples) // 2] * 1e3, "p99_ms": samples[int(0.99 * len(samples))] * 1e3}


def throughput(url: str, seconds: int, conf_dir: Path) -> float:
    script = conf_dir / "post.lua"
    script.write_text(
        f'wrk.method = "POST"\nwrk.body = {json.dumps(json.dumps(REQUEST))}\n'
        'wrk.headers["Content-Type"] = "application/json"\n'
        f'wrk.headers["Authorization"] = "Bearer {API_KEY}"\n'
    )
    out = subprocess.run(
        ["taskset", "-c", "0", "wrk", "-t1", "-c64", f"-d{seconds}s", "-s", str(script), url + "/v1/chat/completions"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    non_2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    if non_2xx:
        raise RuntimeError(f"{url}: {non_2xx.group(1)} failed responses under load:\n{out}")
    return float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--seconds", type=int, default=10)
    parser.add_argument(
        "--trace-sample-ratio",
        type=float,
        default=1.0,
        help="shoal's router.tracing.sample_ratio (1.0, the default: every request traced)",
    )
    args = parser.parse_args()
    litellm = ensure_tools()
    conf_dir = Path(tempfile.mkdtemp(prefix="shoal-router-bench-"))
    processes = []
    try:
        upstream_port = free_port()
        answer = json.dumps(json.dumps(COMPLETION))[1:-1].replace("'", "\\'")
        processes.append(
            nginx(
                conf_dir,
                "upstream",
                f"""server {{ listen 127.0.0.1:{upstream_port};
            location = /v1/chat/completions {{ default_type application/json; return 200 '{answer}'; }}
            location = /v1/models {{ default_type application/json;
                return 200 '{{"object":"list","data":[{{"id":"bench","object":"model"}}]}}'; }} }}""",
                cpu=0,
            )
        )
        upstream = f"http://127.0.0.1:{upstream_port}"
        wait_up(upstream, processes[-1])

        targets = {"direct": upstream}
        shoal_port = free_port()
        config = conf_dir / "router.yaml"
        config.write_text(
            json.dumps(
                {
                    "workers": [{"url": upstream, "models": ["bench"]}],
                    "api_keys": [{"sha256": hashlib.sha256(API_KEY.encode()).hexdigest()}],
                    "tracing": {"sample_ratio": args.trace_sample_ratio},
                }
            )
        )
        processes.append(
            subprocess.Popen(
                [
                    "taskset",
                    "-c",
                    "1",
                    sys.executable,
                    "-m",
                    "shoal.cli",
                    "router",
                    "--port",
                    str(shoal_port),
                    "--config",
                    str(config),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        targets["shoal"] = f"http://127.0.0.1:{shoal_port}"
        wait_up(targets["shoal"], processes[-1])

        nginx_port = free_port()
        processes.append(
            nginx(
                conf_dir,
                "proxy",
                f"""upstream up {{ server 127.0.0.1:{upstream_port}; keepalive 128; }}
            server {{ listen 127.0.0.1:{nginx_port}; location / {{ proxy_pass http://up;
                proxy_http_version 1.1; proxy_set_header Connection ""; }} }}""",
                cpu=1,
            )
        )
        targets["nginx"] = f"http://127.0.0.1:{nginx_port}"
        wait_up(targets["nginx"], processes[-1])

        litellm_port = free_port()
        litellm_config = conf_dir / "litellm.yaml"
        litellm_config.write_text(
            json.dumps(
                {
                    "model_list": [
                        {
                            "model_name": "bench",
                            "litellm_params": {
                                "model": "openai/bench",
                                "api_base": upstream + "/v1",
                                "api_key": "unused",
                            },
                        }
                    ]
                }
            )
        )
        processes.append(
            subprocess.Popen(
                [
                    "taskset",
                    "-c",
                    "1",
                    str(litellm),
                    "--config",
                    str(litellm_config),
                    "--port",
                    str(litellm_port),
                    "--num_workers",
                    "1",
                ],
                env={**os.environ, "LITELLM_TELEMETRY": "False", "LITELLM_LOG": "ERROR", "LITELLM_MASTER_KEY": API_KEY},
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
        targets["litellm"] = f"http://127.0.0.1:{litellm_port}"
        wait_up(targets["litellm"], processes[-1], timeout_s=300)

        results = {}
        for name, url in targets.items():
            results[name] = {**latency(url, args.requests), "requests_per_s": throughput(url, args.seconds, conf_dir)}
            print(
                f"{name:>8}: p50 {results[name]['p50_ms']:.3f} ms, p99 {results[name]['p99_ms']:.3f} ms, "
                f"{results[name]['requests_per_s']:.0f} req/s",
                flush=True,
            )
        for name in ("shoal", "nginx", "litellm"):
            results[name]["added_p50_ms"] = results[name]["p50_ms"] - results["direct"]["p50_ms"]
            results[name]["added_p99_ms"] = results[name]["p99_ms"] - results["direct"]["p99_ms"]
        print(
            f"added by shoal: p50 {results['shoal']['added_p50_ms']:.3f} ms, p99 {results['shoal']['added_p99_ms']:.3f} ms; "
            f"shoal / litellm req/s: {results['shoal']['requests_per_s'] / results['litellm']['requests_per_s']:.2f}; "
            f"shoal / nginx req/s: {results['shoal']['requests_per_s'] / results['nginx']['requests_per_s']:.2f}"
        )
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
