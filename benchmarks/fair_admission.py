"""Fair shares between tenants, through a real router in front of one worker: three tenants send closed
loops of streamed completions, the heavy one with ten times the others' concurrency, for
`--duration-s`. Run twice on the same traffic: each tenant with its own API key (fair shares), and
all three on one key (one tenant: first come, first served), after a warm-up run. Reported: output tokens per tenant,
Jain's fairness index over the tenants (1 is an equal share each; they are all backlogged
throughout), and total output tokens a second.

    .venv/bin/python benchmarks/fair_admission.py [--duration-s 40] [--light 2] [--slots 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
from cpu_name import cpu_description
from routing_quality import start_router
from speculative import shoal_worker, start

from shoal.router.admission.auth import key_hash

RESULTS = Path(__file__).parent / "results"
TENANTS = ("heavy", "light-a", "light-b")


def jain(values: list[float]) -> float:
    return sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else 0.0


async def tenant_loop(url: str, key: str, tenant: str, concurrency: int, until: float, served: dict) -> None:
    body = {"model": "bench", "prompt": "Tell me about lighthouses.", "max_tokens": 24, "ignore_eos": True}

    async def one_client(client: httpx.AsyncClient) -> None:
        while time.monotonic() < until:
            answer = await client.post("/v1/completions", json=body, headers={"authorization": f"Bearer {key}"})
            if answer.status_code == 200 and time.monotonic() < until:
                served[tenant] += answer.json()["usage"]["completion_tokens"]

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        await asyncio.gather(*(one_client(client) for _ in range(concurrency)))


def run(worker_url: str, work: Path, args, fair: bool) -> dict:
    keys = {tenant: f"sk-{tenant}" if fair else "sk-shared" for tenant in TENANTS}
    config = {
        "workers": [{"url": worker_url}],
        "admission": {"max_in_flight_per_worker": args.slots, "queue_timeout_s": 600},
        "api_keys": [{"name": key, "sha256": key_hash(key)} for key in set(keys.values())],
        "health": {"canary_interval_s": 3600},
    }
    router, url = start_router(config, work, f"router-{'fair' if fair else 'fifo'}")
    try:
        served = dict.fromkeys(TENANTS, 0)
        started = time.monotonic()
        until = started + args.duration_s
        concurrency = {"heavy": 10 * args.light, "light-a": args.light, "light-b": args.light}

        async def everyone() -> None:
            await asyncio.gather(*(tenant_loop(url, keys[t], t, concurrency[t], until, served) for t in TENANTS))

        asyncio.run(everyone())
    finally:
        router.terminate()
        router.wait(timeout=30)
    return {
        "tokens": served,
        "jain_index": round(jain(list(served.values())), 3),
        "tokens_per_s": round(sum(served.values()) / args.duration_s, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--duration-s", type=float, default=40.0)
    parser.add_argument("--light", type=int, default=2, help="each light tenant's concurrent clients")
    parser.add_argument("--slots", type=int, default=2, help="the router's max_in_flight_per_worker")
    parser.add_argument("--warm-up-s", type=float, default=15.0, help="a first run, not counted")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="shoal-fair-"))
    process, worker_url = start(shoal_worker(args.model, []), work / "worker.log")
    try:
        run(worker_url, work, argparse.Namespace(**{**vars(args), "duration_s": args.warm_up_s}), fair=True)
        results = {"first come, first served": run(worker_url, work, args, fair=False)}
        results["fair shares"] = run(worker_url, work, args, fair=True)
    finally:
        process.terminate()
        process.wait(timeout=30)
    fifo, fair = results["first come, first served"], results["fair shares"]
    report = {
        "cpu": cpu_description(),
        **vars(args),
        "results": results,
        "throughput_ratio": round(fair["tokens_per_s"] / fifo["tokens_per_s"], 3),
    }
    print(json.dumps(report, indent=2), flush=True)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"fair-admission-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(report, indent=2))
    print("->", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
