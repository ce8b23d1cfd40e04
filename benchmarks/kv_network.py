"""KV transfer between hosts: a worker on host "a" of a test bed of network namespaces
(tests/support/testbed.py) holds a long prompt's KV; a process on host "b" fetches it from the
worker's KV peer over the veth link, as a worker does (CURVE-encrypted ZeroMQ, a fresh connection
per fetch), and reports the time per fetch, per block, and the throughput. With --rate the link is
shaped by tc tbf first (a slower network). Needs root (namespaces).

    .venv/bin/python benchmarks/kv_network.py                   # SmolLM2-135M-Instruct, 2048 tokens
    .venv/bin/python benchmarks/kv_network.py --rate 1gbit
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from routing_quality import wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.support.testbed import NetworkBed

RESULTS = Path(__file__).parent / "results"
SECRET = "kv-network-benchmark"
WORKER_PORT = 8001

FETCHER = """
import json, sys, time
from shoal.parallel.cluster_sockets import ClusterContext
from shoal.worker.kv_peer import fetch_kv
address, prompt, repeats = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
context = ClusterContext(sys.argv[4])
seconds = []
for _ in range(repeats + 1):
    started = time.perf_counter()
    blocks = fetch_kv(context, address, prompt, 120, shared_memory=False)
    seconds.append(time.perf_counter() - started)
print(json.dumps({"seconds": seconds[1:], "blocks": len(blocks.hashes), "bytes": blocks.nbytes}))
context.close()
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--rate", default=None, help="shape host a's link with tc tbf (e.g. 1gbit)")
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="shoal-kv-network-"))
    bed = NetworkBed(["a", "b"]).up()
    env = {**os.environ, "SHOAL_CLUSTER_SECRET": SECRET}
    try:
        a = bed["a"]
        worker = a.popen(
            [sys.executable, "-m", "shoal.cli", "worker", "--model", args.model, "--host", a.address]
            + ["--port", str(WORKER_PORT), "--kv-cache", "512MiB", "--max-model-len", str(args.tokens + 64)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=open(log_dir / "worker.log", "a"),  # noqa: SIM115 (the process holds it)
        )
        url = a.url(WORKER_PORT)
        wait_for(url + "/ready", worker)
        prompt = [(7 + 31 * i) % 40000 + 50 for i in range(args.tokens)]
        body = {"model": args.model, "prompt": prompt, "max_tokens": 1}
        httpx.post(url + "/v1/completions", json=body, timeout=600).raise_for_status()
        address = httpx.get(url + "/load", timeout=10).json()["kv_peer"]
        if args.rate:
            a.slow(args.rate, burst="256kb", latency="50ms")
        fetched = bed["b"].popen(
            [sys.executable, "-c", FETCHER, address, json.dumps(prompt), str(args.repeats), SECRET],
            env=env,
            stdout=subprocess.PIPE,
            stderr=open(log_dir / "fetcher.log", "a"),  # noqa: SIM115
        )
        out, _ = fetched.communicate(timeout=600)
        run = json.loads(out)
        worker.terminate()
        worker.wait(timeout=60)
    finally:
        bed.down()
    median = sorted(run["seconds"])[len(run["seconds"]) // 2]
    result = {
        "args": vars(args),
        "cpus": os.cpu_count(),
        "blocks": run["blocks"],
        "kv_bytes": run["bytes"],
        "seconds": run["seconds"],
        "median_ms": round(median * 1e3, 1),
        "us_per_block": round(median / max(run["blocks"], 1) * 1e6),
        "gb_per_s": round(run["bytes"] / median / 1e9, 2),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "args"}))
    RESULTS.mkdir(exist_ok=True)
    output = RESULTS / f"kv-network-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    output.write_text(json.dumps(result, indent=1))
    print(f"results in {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
