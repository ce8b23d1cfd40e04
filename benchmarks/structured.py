"""The cost of structured output: one `shoal worker` of the bundled model, the same chat prompts run
free and constrained by a JSON schema, and the grammar engines compared on the model's tokenizer.

Reported:
- generated tokens/s at concurrency 1 and 32, free (EOS ignored) against json_schema (an array of
  bounded records, long enough to run to max_tokens), the median of --repeats interleaved runs of
  each, and their ratio (target: constrained at most 10% slower at c=32);
- first-token latency with a schema the worker has not seen against the same schema again (cached);
- grammar compile time of a typical tool schema, and the time to compute one token mask, for
  llguidance (what shoal uses) and xgrammar (installed with --no-deps into benchmarks/.peers, run
  on this venv's torch), on the bundled tokenizer.

    .venv/bin/python benchmarks/structured.py [--requests 64] [--max-tokens 96] [--repeats 3] [--skip-engines] [--skip-serving]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
from worker_http import RequestTiming, distribution, free_port, run_workload

RESULTS = Path(__file__).parent / "results"
PEERS = Path(__file__).parent / ".peers"
MODEL = "smollm2-135m-instruct"
RECORDS = {
    "type": "object",
    "properties": {
        "records": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "city": {"type": "string", "maxLength": 24},
                    "member": {"type": "boolean"},
                },
                "required": ["name", "age", "city", "member"],
                "additionalProperties": False,
            },
            "minItems": 40,
        }
    },
    "required": ["records"],
    "additionalProperties": False,
}
TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "location": {"type": "string", "description": "City and country"},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "include": {"type": "array", "items": {"enum": ["wind", "rain", "uv", "pollen"]}, "maxItems": 4},
        "details": {
            "type": "object",
            "properties": {"hourly": {"type": "boolean"}, "language": {"type": "string", "pattern": "^[a-z]{2}$"}},
            "required": ["hourly"],
            "additionalProperties": False,
        },
    },
    "required": ["location", "unit", "days"],
    "additionalProperties": False,
}
TOOL_ARGUMENTS = {
    "location": "Paris, France",
    "unit": "celsius",
    "days": 3,
    "include": ["wind", "rain"],
    "details": {"hourly": True, "language": "fr"},
}


def log(message: str) -> None:
    print(message, flush=True)


def chat_body(index: int, max_tokens: int, schema: dict | None, stream: bool = True) -> dict:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"List people living in city number {index} as JSON records."}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": stream,
    }
    if schema is None:
        return {**body, "ignore_eos": True}
    return {**body, "response_format": {"type": "json_schema", "json_schema": {"name": "records", "schema": schema}}}


async def throughput(url: str, requests: int, concurrency: int, max_tokens: int, schema: dict | None) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        counter = iter(range(requests))

        async def submit(_: object, timing: RequestTiming) -> None:
            body = chat_body(next(counter), max_tokens, schema)
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                response.raise_for_status()
                async for line in response.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        now = time.perf_counter()
                        for choice in json.loads(line[6:]).get("choices") or []:
                            timing.token_times.extend(now for _ in choice.get("token_ids") or [])

        result = await run_workload(submit, [None] * requests, concurrency)
    return result.summary()


def first_token_s(url: str, schema: dict) -> float:
    started = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=chat_body(0, 4, schema), timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if '"token_ids": [' in line and '"token_ids": []' not in line:
                return time.perf_counter() - started
    raise RuntimeError("no token came back")


def serve_worker() -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen(
        [sys.executable, "-m", "shoal.cli", "worker", "--port", str(port), "--max-num-seqs", "64"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                return process, url
        except httpx.HTTPError:
            time.sleep(0.5)
    process.kill()
    raise RuntimeError("the worker did not start")


def measure_serving(args: argparse.Namespace) -> dict:
    process, url = serve_worker()
    try:
        figures: dict = {}
        for concurrency in (1, 32):
            requests = min(max(concurrency * 2, 4), args.requests)
            runs: dict[str, list[dict]] = {"free": [], "json_schema": []}
            for _ in range(args.repeats):  # interleaved, so that drifts of the machine hit both alike
                for label, schema in (("free", None), ("json_schema", RECORDS)):
                    asyncio.run(throughput(url, min(concurrency, 4), concurrency, 8, schema))  # warm-up
                    runs[label].append(asyncio.run(throughput(url, requests, concurrency, args.max_tokens, schema)))
                    log(f"  c={concurrency} {label}: {runs[label][-1]['tokens_per_s']:.1f} tokens/s")
            for label, summaries in runs.items():
                figures[f"c{concurrency}_{label}"] = sorted(summaries, key=lambda s: s["tokens_per_s"])[
                    len(summaries) // 2
                ]
            figures[f"c{concurrency}_ratio"] = (
                figures[f"c{concurrency}_json_schema"]["tokens_per_s"] / figures[f"c{concurrency}_free"]["tokens_per_s"]
            )
        fresh = [first_token_s(url, {**RECORDS, "title": f"fresh {i} {time.time()}"}) for i in range(3)]
        cached = [first_token_s(url, RECORDS) for _ in range(3)]
        figures["ttft_new_schema_s"] = distribution(fresh)
        figures["ttft_cached_schema_s"] = distribution(cached)
        log(f"  first token: new schema {min(fresh) * 1e3:.1f} ms, cached {min(cached) * 1e3:.1f} ms (best of 3)")
        return figures
    finally:
        process.terminate()
        process.wait(timeout=60)


def engine_figures() -> dict:
    """Runs in the child process: compile and mask times of both engines on the bundled tokenizer."""
    from shoal.engine.grammar import JSON_OPTIONS, GrammarCompiler
    from shoal.engine.structured_outputs import StructuredOutputs
    from shoal.model.loader import load_checkpoint

    tokenizer = load_checkpoint(MODEL).tokenizer
    vocab = tokenizer.vocab_size
    figures: dict = {"vocab": vocab}

    compiler = GrammarCompiler(tokenizer, vocab, tokenizer.eos_token_ids)
    started = time.perf_counter()
    compiler.compile(StructuredOutputs(regex="a"))
    figures["llguidance_tokenizer_s"] = time.perf_counter() - started
    compiles = []
    for i in range(5):
        spec = StructuredOutputs.from_schema({**TOOL_SCHEMA, "title": f"t{i}"}, "x")
        started = time.perf_counter()
        compiler.compile(spec)
        compiles.append(time.perf_counter() - started)
    figures["llguidance_compile_s"] = min(compiles)
    text = json.dumps(TOOL_ARGUMENTS, separators=(JSON_OPTIONS["item_separator"], JSON_OPTIONS["key_separator"]))
    ids = tokenizer.encode(text, add_special_tokens=False)
    matcher = compiler.matcher(spec)
    started = time.perf_counter()
    for token in ids:
        compiler.allowed_tokens([matcher])
        matcher.consume_token(token)
    figures["llguidance_mask_us"] = (time.perf_counter() - started) / len(ids) * 1e6
    matchers = [compiler.matcher(spec) for _ in range(32)]
    started = time.perf_counter()
    for token in ids:
        compiler.allowed_tokens(matchers)
        for m in matchers:
            m.consume_token(token)
    figures["llguidance_mask_batch32_us_per_row"] = (time.perf_counter() - started) / len(ids) / 32 * 1e6

    import xgrammar

    started = time.perf_counter()
    info = xgrammar.TokenizerInfo(
        [tokenizer.backend.id_to_token(i) for i in range(vocab)],
        vocab_type=xgrammar.VocabType.BYTE_LEVEL,
        vocab_size=vocab,
        stop_token_ids=list(tokenizer.eos_token_ids),
    )
    grammar_compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    figures["xgrammar_tokenizer_s"] = time.perf_counter() - started
    compiles = []
    for i in range(5):
        started = time.perf_counter()
        compiled = grammar_compiler.compile_json_schema(
            json.dumps({**TOOL_SCHEMA, "title": f"t{i}"}), any_whitespace=False
        )
        compiles.append(time.perf_counter() - started)
    figures["xgrammar_compile_s"] = min(compiles)
    x_ids = tokenizer.encode(json.dumps(TOOL_ARGUMENTS), add_special_tokens=False)
    matcher = xgrammar.GrammarMatcher(compiled)
    bitmask = xgrammar.allocate_token_bitmask(1, vocab)
    started = time.perf_counter()
    for token in x_ids:
        matcher.fill_next_token_bitmask(bitmask, 0)
        matcher.accept_token(token)
    figures["xgrammar_mask_us"] = (time.perf_counter() - started) / len(x_ids) * 1e6
    unsupported = {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}
    try:
        grammar_compiler.compile_json_schema(json.dumps(unsupported))
        figures["xgrammar_uniqueItems"] = "compiled (keyword dropped)"
    except Exception as exc:  # noqa: BLE001
        figures["xgrammar_uniqueItems"] = f"refused: {exc}"
    try:
        compiler.compile(StructuredOutputs.from_schema(unsupported, "x"))
        figures["llguidance_uniqueItems"] = "compiled"
    except Exception as exc:  # noqa: BLE001
        figures["llguidance_uniqueItems"] = f"refused: {exc}"
    return figures


def measure_engines() -> dict:
    """Installs xgrammar (no dependencies: it runs on this venv's torch) beside the benchmark, then
    measures both engines in a child process that can import it."""
    target = PEERS / "xgrammar-lib"
    if not (target / "xgrammar").exists():
        log(f"  installing xgrammar into {target} (first use)")
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(target), "xgrammar==0.2.9"]
            + ["apache-tvm-ffi==0.1.15.post2"],
            check=True,
        )
    env = {**os.environ, "PYTHONPATH": f"{target}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    child = subprocess.run(
        [sys.executable, __file__, "--engines-child"], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(child.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if line.startswith("Model name")), "?")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each side; the median is reported")
    parser.add_argument("--skip-engines", action="store_true")
    parser.add_argument("--skip-serving", action="store_true")
    parser.add_argument("--engines-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engines_child:
        print(json.dumps(engine_figures()))
        return 0
    results = {"cpu": cpu_name(), "cores": os.cpu_count()}
    log(f"structured output on {results['cpu']} ({results['cores']} cores)")
    if not args.skip_engines:
        results["engines"] = measure_engines()
        log(json.dumps(results["engines"], indent=2))
    if not args.skip_serving:
        serving = results["serving"] = measure_serving(args)
        log(f"ratios json_schema/free: c=1 {serving['c1_ratio']:.3f}, c=32 {serving['c32_ratio']:.3f}")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"structured-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(results, indent=2))
    log(f"results in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
