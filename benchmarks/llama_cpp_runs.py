"""llama.cpp (llama-cpp-python) on the benchmark's prompts, run inside its own venv (see llama_cpp_peer).

    <llama-cpp venv>/bin/python benchmarks/llama_cpp_runs.py REQUEST.json

REQUEST.json: {"gguf", "threads", "use_extra_bufts", "mode", "new_tokens", "warm": [[ids]], "prompts": [[ids]]}.
Modes:
- "probe": a 4-token decode with llama.cpp's default CPU setup (extra buffer types: AMX, repacked
  weights), which crashed on one machine; the exit status says whether it works.
- "single": the high-level API, one stream: `Llama.generate` yields each greedy token (EOS is not a
  stop), after a warm-up on another prompt.
- "batched": real parallel sequences through the C API: one `llama_decode` per step for every
  request (one seq_id each, one KV stream per sequence), all prompts prefilled in one batch, greedy
  argmax over each row's logits.
Prints one line `LLAMA_RESULT <json>`: the submit time, every request's token timestamps and ids,
and the cores other processes used meanwhile. Imports llama-cpp-python, numpy and the standard
library only: it runs outside shoal's venv.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

from cpu_monitor import CpuMonitor

RESULT_PREFIX = "LLAMA_RESULT "


def probe(request: dict[str, Any]) -> None:
    import llama_cpp as lc

    lc.llama_backend_init()
    params = lc.llama_model_default_params()
    params.use_extra_bufts = True
    model = lc.llama_model_load_from_file(request["gguf"].encode(), params)
    context_params = lc.llama_context_default_params()
    context_params.n_ctx, context_params.n_batch = 64, 64
    context_params.n_threads = context_params.n_threads_batch = request["threads"]
    ctx = lc.llama_init_from_model(model, context_params)
    batch = lc.llama_batch_get_one((lc.llama_token * 4)(1, 2, 3, 4), 4)
    sys.exit(lc.llama_decode(ctx, batch))


def single(request: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp
    import llama_cpp.llama as high_level

    original = high_level.llama_cpp.llama_model_default_params

    def model_params() -> Any:
        params = original()
        params.use_extra_bufts = request["use_extra_bufts"]
        return params

    high_level.llama_cpp.llama_model_default_params = model_params
    prompt, count = request["prompts"][0], request["new_tokens"]
    llm = llama_cpp.Llama(
        model_path=request["gguf"],
        n_ctx=len(prompt) + count + 64,
        n_threads=request["threads"],
        n_threads_batch=request["threads"],
        n_batch=512,
        verbose=False,
    )

    def stream(ids: list[int], limit: int) -> tuple[float, list[float], list[int]]:
        llm.reset()  # forget the previous prompt: generate() would otherwise reuse its KV for a common prefix
        t0 = time.perf_counter()
        times, tokens = [], []
        for token in llm.generate(ids, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
            times.append(time.perf_counter())
            tokens.append(int(token))
            if len(tokens) == limit:
                break
        return t0, times, tokens

    stream(request["warm"][0], 8)
    with CpuMonitor() as monitor:
        t0, times, tokens = stream(prompt, count)
    llm.close()
    return {"t0": t0, "times": [times], "outputs": [tokens], "other_cores": monitor.other_cores}


def batched(request: dict[str, Any]) -> dict[str, Any]:
    import llama_cpp as lc
    import numpy as np
    from llama_cpp._logger import set_verbose

    set_verbose(False)  # llama.cpp's load and graph logs
    lc.llama_backend_init()
    model_params = lc.llama_model_default_params()
    model_params.use_extra_bufts = request["use_extra_bufts"]
    model = lc.llama_model_load_from_file(request["gguf"].encode(), model_params)
    if not model:
        raise RuntimeError("llama.cpp could not load the model")
    n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(model))
    if len(request["prompts"]) > lc.llama_max_parallel_sequences():
        raise RuntimeError(f"above llama.cpp's {lc.llama_max_parallel_sequences()} parallel sequences")

    def run(prompts: list[list[int]], count: int) -> dict[str, Any]:
        c = len(prompts)
        prompt_total = sum(map(len, prompts))
        cp = lc.llama_context_default_params()
        # One KV stream per sequence (kv_unified off): each request attends over its own cells only.
        per_seq = -(-(max(map(len, prompts)) + count + 8) // 256) * 256
        cp.n_ctx = c * per_seq
        cp.n_batch = max(prompt_total, c, 512)
        cp.n_ubatch = 512
        cp.n_seq_max = c
        cp.n_threads = cp.n_threads_batch = request["threads"]
        cp.kv_unified = False
        cp.no_perf = True
        ctx = lc.llama_init_from_model(model, cp)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        batch = lc.llama_batch_init(max(prompt_total, c), 0, 1)
        try:

            def fill(entries: list[tuple[int, int, int, bool]]) -> None:
                batch.n_tokens = len(entries)
                for i, (token, pos, seq, want) in enumerate(entries):
                    batch.token[i] = token
                    batch.pos[i] = pos
                    batch.n_seq_id[i] = 1
                    batch.seq_id[i][0] = seq
                    batch.logits[i] = 1 if want else 0

            def decode() -> None:
                if lc.llama_decode(ctx, batch) != 0:
                    raise RuntimeError("llama_decode failed")

            def argmax(i: int) -> int:
                return int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).argmax())

            # Warm this context (first decodes allocate and plan graphs), then empty its KV cache.
            k = max(1, min(512, prompt_total) // c)  # fits the batch and each sequence's cells
            for entries in (
                [(1, pos, s, pos == k - 1) for s in range(c) for pos in range(k)],
                [(1, k, s, True) for s in range(c)],
            ):
                fill(entries)
                decode()
            lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
            times: list[list[float]] = [[] for _ in prompts]
            outputs: list[list[int]] = [[] for _ in prompts]
            with CpuMonitor() as monitor:
                t0 = time.perf_counter()
                entries, last_index = [], []
                for s, p in enumerate(prompts):
                    entries += [(token, pos, s, pos == len(p) - 1) for pos, token in enumerate(p)]
                    last_index.append(len(entries) - 1)
                fill(entries)
                decode()
                chosen = [argmax(i) for i in last_index]
                for step in range(count):
                    if step:
                        fill([(chosen[s], len(prompts[s]) + step - 1, s, True) for s in range(c)])
                        decode()
                        chosen = [argmax(i) for i in range(c)]
                    now = time.perf_counter()
                    for s in range(c):
                        outputs[s].append(chosen[s])
                        times[s].append(now)
            return {"t0": t0, "times": times, "outputs": outputs, "other_cores": monitor.other_cores}
        finally:
            lc.llama_batch_free(batch)
            lc.llama_free(ctx)

    run(request["warm"][: len(request["prompts"])], 8)
    result = run(request["prompts"], request["new_tokens"])
    lc.llama_model_free(model)
    return result


def main(request_path: str) -> None:
    request = json.loads(open(request_path).read())
    if request["mode"] == "probe":
        probe(request)
    result = single(request) if request["mode"] == "single" else batched(request)
    import llama_cpp

    print(RESULT_PREFIX + json.dumps({"version": llama_cpp.__version__, **result}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
