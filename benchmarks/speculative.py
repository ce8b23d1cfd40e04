"""Speculative decoding through the worker's HTTP server: the same requests to a worker without
speculation and to one with prompt lookup (`--speculative-method ngram`), one after the other on
this machine. Workloads: a code edit (return a ~300-token function with one name changed; c=1),
free chat with little repetition (c=1), and free chat at c=32. Reported: output tokens per second
of each and the ratio, and whether every answer is the same text.

    .venv/bin/python benchmarks/speculative.py
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from cpu_name import cpu_description
from routing_quality import free_port, wait_for

RESULTS = Path(__file__).parent / "results"
FUNCTION = '''def summarize_orders(orders, tax_rate=0.2, currency="EUR"):
    """Totals per customer, with tax, skipping cancelled orders."""
    totals = {}
    for order in orders:
        if order.get("status") == "cancelled":
            continue
        customer = order["customer"]
        subtotal = 0.0
        for line in order["lines"]:
            price = line["unit_price"] * line["quantity"]
            if line.get("discount"):
                price -= price * line["discount"]
            subtotal += price
        total = subtotal * (1 + tax_rate)
        totals.setdefault(customer, 0.0)
        totals[customer] += round(total, 2)
    report = []
    for customer, total in sorted(totals.items(), key=lambda item: -item[1]):
        report.append(f"{customer}: {total:.2f} {currency}")
    return "\\n".join(report)
'''
CODE_EDIT = (
    "Return this Python function unchanged except that the variable `subtotal` is renamed to `net`. "
    f"Reply with the code only.\n\n```python\n{FUNCTION}```"
)
CHAT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def start_worker(model: str, extra: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "worker", "--model", model, "--port", str(port), *extra],
        stdout=subprocess.DEVNULL,
        stderr=open(log, "a"),
    )
    url = f"http://127.0.0.1:{port}"
    wait_for(url + "/ready", process)
    return process, url


async def run(url: str, prompt: str, max_tokens: int, concurrency: int, requests: int) -> dict:
    """`requests` greedy chat requests, `concurrency` at a time: output tokens a second, and the texts."""
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    texts, tokens = [], 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        started = time.perf_counter()
        for first in range(0, requests, concurrency):
            batch = [
                client.post("/v1/chat/completions", json={**body, "temperature": 0, "seed": i})
                for i in range(first, min(requests, first + concurrency))
            ]
            for response in await asyncio.gather(*batch):
                answer = response.json()
                texts.append(answer["choices"][0]["message"]["content"])
                tokens += answer["usage"]["completion_tokens"]
        seconds = time.perf_counter() - started
    return {"tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1), "texts": texts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=3, help="per c=1 workload")
    args = parser.parse_args()
    log_dir = Path(tempfile.mkdtemp(prefix="shoal-speculative-"))
    workloads = {
        "code_edit_c1": (CODE_EDIT, 400, 1, args.requests),
        "free_chat_c1": (CHAT, 200, 1, args.requests),
        "free_chat_c32": (CHAT, 64, 32, 32),
    }
    modes = {"plain": [], "ngram": ["--speculative-method", "ngram"]}
    results: dict = {}
    for mode, flags in modes.items():
        process, url = start_worker(args.model, ["--served-model-name", "bench", *flags], log_dir / f"{mode}.log")
        try:
            asyncio.run(run(url, CHAT, 16, 1, 1))  # warm-up
            results[mode] = {name: asyncio.run(run(url, *spec)) for name, spec in workloads.items()}
        finally:
            process.terminate()
            process.wait(timeout=30)
    report = {"cpu": cpu_description(), "model": args.model, "workloads": {}}
    for name in workloads:
        plain, ngram = results["plain"][name], results["ngram"][name]
        report["workloads"][name] = {
            "plain_tokens_per_s": plain["tokens_per_s"],
            "ngram_tokens_per_s": ngram["tokens_per_s"],
            "ratio": round(ngram["tokens_per_s"] / plain["tokens_per_s"], 2),
            "same_text": plain["texts"] == ngram["texts"],
        }
        print(name, json.dumps(report["workloads"][name]), flush=True)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"speculative-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(report, indent=2))
    print("->", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
