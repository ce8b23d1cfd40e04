"""Speculative decoding through the HTTP server, shoal and llama.cpp on the same GGUF file, the same
requests to each server one after the other on this machine. Each speculating server is compared
with its own plain one:

- shoal, the file's quantized blocks as they are (the bundled model's are Q4_1): plain, and prompt
  lookup (`{"method": "ngram"}`);
- shoal, the file's weights dequantized to bfloat16: plain, and the file as it is drafting for them
  (`{"method": "draft_model", "model": <the same file>}`: a quantized self-draft);
- llama.cpp (llama-cpp-python's server, 2 threads): plain, and its prompt lookup
  (`--draft_model prompt-lookup-decoding`, 10 tokens a draft, its own default), c=1 workloads only (it
  serves one request at a time).

Workloads: a code edit (return a ~300-token function with one name changed; c=1), free chat with
little repetition (c=1), and free chat at c=32. Reported: output tokens per second of each, the
ratio to the plain server, and whether every answer is the same text as the plain server's; the
servers run in turn `--rounds` times (2), and each one's best round counts (this machine is shared).
`--model` takes another GGUF file (`--completions` for one without a chat template).

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
from peer_servers import llama_server_command
from peer_venv import python_of
from routing_quality import free_port, wait_for

from shoal.model.registry import resolve_model

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


def shoal_worker(model: str, flags: list[str]):
    """(argv by port, readiness path) of a shoal worker serving `model` as "bench"."""
    return lambda port: [
        sys.executable, "-m", "shoal.cli", "worker", "--model", model, "--port", str(port),
        "--served-model-name", "bench", *flags,
    ], "/ready"  # fmt: skip


def llama_cpp_server(gguf: Path, flags: list[str]):
    """(argv by port, readiness path) of llama-cpp-python's server serving `gguf` as "bench" with 2
    threads."""
    python = python_of("llama-cpp", print)
    return lambda port: [*llama_server_command(python, gguf, "bench", port), "--n_threads", "2", *flags], "/v1/models"


def start(server, log: Path) -> tuple[subprocess.Popen, str]:
    argv, ready = server
    port = free_port()
    process = subprocess.Popen(argv(port), stdout=subprocess.DEVNULL, stderr=open(log, "a"))
    url = f"http://127.0.0.1:{port}"
    wait_for(url + ready, process)
    return process, url


async def run(url: str, prompt: str, max_tokens: int, concurrency: int, requests: int, chat: bool = True) -> dict:
    """`requests` greedy chat requests (completions of the bare prompt unless `chat`), `concurrency`
    at a time: output tokens a second, and the texts."""
    body = {"model": "bench", "max_tokens": max_tokens}
    body.update({"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt})
    path = "/v1/chat/completions" if chat else "/v1/completions"
    texts, tokens = [], 0
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        started = time.perf_counter()
        for first in range(0, requests, concurrency):
            batch = [
                client.post(path, json={**body, "temperature": 0, "seed": i})
                for i in range(first, min(requests, first + concurrency))
            ]
            for response in await asyncio.gather(*batch):
                answer = response.json()
                choice = answer["choices"][0]
                texts.append(choice["message"]["content"] if chat else choice["text"])
                tokens += answer["usage"]["completion_tokens"]
        seconds = time.perf_counter() - started
    return {"tokens": tokens, "seconds": round(seconds, 2), "tokens_per_s": round(tokens / seconds, 1), "texts": texts}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--requests", type=int, default=3, help="per c=1 workload")
    parser.add_argument("--no-llama-cpp", action="store_true", help="shoal's servers only")
    parser.add_argument("--rounds", type=int, default=2, help="each server's best round is reported")
    parser.add_argument(
        "--completions", action="store_true", help="/v1/completions of the bare prompts (a model with no chat template)"
    )
    args = parser.parse_args()
    chat = not args.completions
    log_dir = Path(tempfile.mkdtemp(prefix="shoal-speculative-"))
    workloads = {
        "code_edit_c1": (CODE_EDIT, 400, 1, args.requests, chat),
        "free_chat_c1": (CHAT, 200, 1, args.requests, chat),
        "free_chat_c32": (CHAT, 64, 32, 32, chat),
    }
    bf16 = ["--no-keep-quantized", "--dtype", "bfloat16"]
    self_draft = json.dumps({"method": "draft_model", "model": args.model})
    # (server, its plain counterpart or None, how to start it, workloads it runs)
    servers = [
        ("shoal", None, shoal_worker(args.model, []), list(workloads)),
        ("shoal ngram", "shoal", shoal_worker(args.model, ["--speculative", '{"method": "ngram"}']), list(workloads)),
        ("shoal bf16", None, shoal_worker(args.model, bf16), list(workloads)),
        ("shoal bf16 + quantized self-draft", "shoal bf16", shoal_worker(args.model, [*bf16, "--speculative", self_draft]), list(workloads)),
    ]  # fmt: skip
    if not args.no_llama_cpp:
        gguf = resolve_model(args.model).path
        lookup = ["--draft_model", "prompt-lookup-decoding"]
        c1 = [name for name in workloads if name.endswith("_c1")]
        servers += [
            ("llama.cpp", None, llama_cpp_server(gguf, []), c1),
            ("llama.cpp prompt lookup", "llama.cpp", llama_cpp_server(gguf, lookup), c1),
        ]
    results: dict = {name: {} for name, _, _, _ in servers}
    for _ in range(args.rounds):  # the servers in turn, each round: a disturbance hits one round
        for name, _, argv, names in servers:
            process, url = start(argv, log_dir / f"{name.replace(' ', '_')}.log")
            try:
                for prompt in (CODE_EDIT, CHAT):  # warm-up: each prompt's shapes once
                    asyncio.run(run(url, prompt, 16, 1, 1, chat))
                for workload in names:
                    measured = asyncio.run(run(url, *workloads[workload]))
                    best = results[name].get(workload)
                    if best is None or measured["tokens_per_s"] > best["tokens_per_s"]:
                        results[name][workload] = measured
            finally:
                process.terminate()
                process.wait(timeout=30)
    report = {"cpu": cpu_description(), "model": args.model, "servers": {}}
    for name, plain, _, names in servers:
        report["servers"][name] = {}
        for workload in names:
            measured = results[name][workload]
            row = {"tokens_per_s": measured["tokens_per_s"]}
            if plain is not None:
                baseline = results[plain][workload]
                row["ratio_to_plain"] = round(measured["tokens_per_s"] / baseline["tokens_per_s"], 2)
                row["same_text"] = measured["texts"] == baseline["texts"]
            report["servers"][name][workload] = row
            print(f"{name:26s} {workload:14s} {json.dumps(row)}", flush=True)
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"speculative-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    path.write_text(json.dumps(report, indent=2))
    print("->", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
