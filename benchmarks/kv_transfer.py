"""KV transfer on one host, against recomputing: two engines of the same model in this process; the
first prefills a long prompt, then its cached blocks are exported, framed for the wire (the bytes a
socket would carry), read back and imported into the second, each stage timed; then the second
engine prefills the same prompt from nothing (what a migration by recompute costs) and from the
imported blocks. Reported per stage: milliseconds, microseconds per block, and GB/s of KV. Then
the same blocks fetched through the first engine's KV peer as a worker fetches them: in the
socket's frames, and through shared memory.

    .venv/bin/python benchmarks/kv_transfer.py                  # SmolLM2-135M-Instruct, bfloat16
    .venv/bin/python benchmarks/kv_transfer.py --tokens 4096
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

from shoal.config.engine import EngineConfig
from shoal.engine.async_engine import AsyncLLMEngine
from shoal.engine.engine import LLMEngine
from shoal.engine.kv_transfer import from_frames, to_frames
from shoal.engine.sampling_params import SamplingParams
from shoal.parallel.cluster_sockets import ClusterContext
from shoal.worker.kv_peer import KVPeer, fetch_kv

RESULTS = Path(__file__).parent / "results"


def prefill_seconds(engine: LLMEngine, prompt: list[int]) -> float:
    """Seconds to the first token of `prompt` (one generated token)."""
    started = time.perf_counter()
    engine.add_request(f"r{started}", prompt, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return time.perf_counter() - started


async def through_peers(sender: LLMEngine, prompt: list[int], repeats: int) -> dict[str, list[float]]:
    """Seconds to fetch the prompt's blocks from a KV peer serving `sender`, as a worker does
    (CURVE-encrypted ZeroMQ over loopback TCP), with the tensors in the socket's frames and in a
    shared-memory segment."""
    engine = AsyncLLMEngine(lambda: sender)
    context = ClusterContext("kv-transfer-benchmark")
    peer = KVPeer(engine, context, "127.0.0.1", asyncio.get_running_loop())
    ways = {"socket frames": False, "shared memory": True}
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    try:
        for _ in range(repeats + 1):  # the first round warms the connection path up
            for way, shared in ways.items():
                started = time.perf_counter()
                await asyncio.to_thread(fetch_kv, context, peer.address, prompt, 60, shared)
                seconds[way].append(time.perf_counter() - started)
        return {way: times[1:] for way, times in seconds.items()}
    finally:
        peer.close()
        context.close()
        engine.shutdown()  # and the sender with it


def timed(times: dict[str, float], stage: str, call):
    """call(), its duration recorded under `stage`."""
    started = time.perf_counter()
    value = call()
    times[stage] = time.perf_counter() - started
    return value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    options = {"model": args.model, "dtype": args.dtype, "kv_cache_bytes": 512 << 20, "max_model_len": args.tokens + 64}
    if args.threads:
        options["num_threads"] = args.threads
    sender = LLMEngine(EngineConfig.from_dict(options))
    vocab = sender.model.config.vocab_size
    prompt = [(7 + 31 * i) % (vocab - 100) + 50 for i in range(args.tokens)]
    prefill_seconds(sender, prompt)
    rows = []
    for repeat in range(args.repeats):
        receiver = LLMEngine(EngineConfig.from_dict(options))
        recompute_s = prefill_seconds(receiver, prompt)
        receiver.shutdown()
        receiver = LLMEngine(EngineConfig.from_dict(options))
        times = {"recompute_prefill": recompute_s}
        exported = timed(times, "export", lambda: sender.export_kv(prompt))
        frames = timed(times, "to_frames", lambda: to_frames(exported))
        wire = timed(times, "wire_copy", lambda: [bytes(frame) for frame in frames])  # what a socket copies
        arrived = timed(times, "from_frames", lambda: from_frames(wire))
        imported = timed(times, "import", lambda: receiver.import_kv(arrived))
        times["prefill_after_import"] = prefill_seconds(receiver, prompt)
        receiver.shutdown()
        blocks, kv_bytes = len(exported.hashes), sum(len(frame) for frame in wire[1:])
        rows.append({"blocks": blocks, "imported": imported, "kv_bytes": kv_bytes, "seconds": times})
        transfer = sum(times[k] for k in ("export", "to_frames", "wire_copy", "from_frames", "import"))
        print(
            f"repeat {repeat + 1}: {blocks} blocks, {kv_bytes / 1e6:.1f} MB; transfer {transfer * 1e3:.1f} ms "
            f"({transfer / blocks * 1e6:.0f} us/block, {kv_bytes / transfer / 1e9:.2f} GB/s); recompute "
            f"{recompute_s * 1e3:.0f} ms; first token after import {times['prefill_after_import'] * 1e3:.1f} ms; "
            + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in times.items()),
            flush=True,
        )
    rows_peer = asyncio.run(through_peers(sender, prompt, args.repeats))
    medians = {stage: sorted(row["seconds"][stage] for row in rows)[len(rows) // 2] for stage in rows[0]["seconds"]}
    lscpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    model_name = next((line.split(":", 1)[1].strip() for line in lscpu.splitlines() if "Model name" in line), "?")
    peer_medians = {way: sorted(times)[len(times) // 2] for way, times in rows_peer.items()}
    print("through a KV peer, median ms:", json.dumps({k: round(v * 1e3, 2) for k, v in peer_medians.items()}))
    result = {
        "args": vars(args),
        "cpu": model_name,
        "cpus": os.cpu_count(),
        "rows": rows,
        "median_s": medians,
        "peer_fetch_s": rows_peer,
        "peer_fetch_median_s": peer_medians,
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"kv-transfer-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(json.dumps(result, indent=2))
    print("median ms:", json.dumps({k: round(v * 1e3, 2) for k, v in medians.items()}))
    print(f"results: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
