"""What batch invariance costs: shoal's engine with batch_invariant on (the default) and off.

On: the native kernels (a packed copy of the weights, one C++ call per decoder layer). Off: torch's
own kernels (one plain multiply per projection over the whole batch, each layer as torch code); the
attention kernel is the same in both. Both run the GGUF's weights dequantized to --dtype (only the
invariant kernels run its quantized blocks). Same model, prompts and settings for both; greedy, 64
new tokens, all requests submitted at once.
Prints generation-phase tokens/s per concurrency and the on/off ratio; writes JSON next to the
engine benchmark's results.

    .venv/bin/python benchmarks/batch_invariance_cost.py [--dtype bfloat16] [--concurrency 1,8,32,64]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from shoal import LLM, SamplingParams

TOPICS = ["rivers", "volcanoes", "bees", "glass", "tides", "chess", "bread", "comets", "owls", "maps", "salt", "jazz"]


def prompts(llm: LLM, count: int) -> list[list[int]]:
    tokenizer = llm.get_tokenizer()
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": f"Describe {TOPICS[i % len(TOPICS)]} ({i})."}]),
            add_special_tokens=False,
        )
        for i in range(count)
    ]


def generation_tokens_per_second(llm: LLM, count: int, new_tokens: int) -> float:
    """Tokens produced after every request had its first token, over the time that took."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts(llm, count)):
        engine.add_request(f"r{count}-{i}", prompt, params)
    started, first_seen, produced = None, set(), 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if started is not None:
            produced += sum(len(o.new_token_ids) for o in outputs)
        first_seen.update(o.request_id for o in outputs)
        if started is None and len(first_seen) == count:
            started = time.perf_counter()
    return produced / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--concurrency", default="1,8,32,64")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2, help="best of this many runs per setting")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    results: dict[str, dict[int, float]] = {}
    for invariant in (True, False):
        llm = LLM(
            dtype=args.dtype, device="cpu", kv_cache_bytes=512 << 20, batch_invariant=invariant, keep_quantized=False
        )
        generation_tokens_per_second(llm, 4, 8)  # warm-up
        results[str(invariant)] = {
            c: max(generation_tokens_per_second(llm, c, args.new_tokens) for _ in range(args.repeats)) for c in levels
        }
    print(f"{'conc':>5} {'invariant tok/s':>16} {'plain tok/s':>12} {'ratio':>6}")
    for c in levels:
        on, off = results["True"][c], results["False"][c]
        print(f"{c:>5} {on:>16.1f} {off:>12.1f} {on / off:>6.2f}")
    out = Path(__file__).parent / "results" / f"batch-invariance-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), "gen_tok_s": results}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
