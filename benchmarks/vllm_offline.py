"""vLLM's CPU engine on the benchmark's prompts, run inside vLLM's own venv (see peer_venv).

    <vllm venv>/bin/python benchmarks/vllm_offline.py REQUEST.json

REQUEST.json: {"model_dir", "dtype", "threads", "kv_cache_gib", "new_tokens", "warmup": [[ids]],
"runs": {"<concurrency>": [[prompt ids], ...]}}. After one warm-up on other prompts, every run
submits all its prompts at once to the
offline `LLM.generate` (greedy, ignore_eos, exactly new_tokens each) and is timed from submit to
the last output. Prints one line `VLLM_RESULT <json>`: per concurrency the wall time, the output
tokens and their ids. Imports only vLLM and the standard library: it runs outside shoal's venv.
"""

from __future__ import annotations

import json
import os
import sys
import time

RESULT_PREFIX = "VLLM_RESULT "


def main(request_path: str) -> None:
    request = json.loads(open(request_path).read())
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(request["kv_cache_gib"]))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("OMP_NUM_THREADS", str(request["threads"]))
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    torch.set_num_threads(request["threads"])
    started = time.perf_counter()
    llm = LLM(model=request["model_dir"], dtype=request["dtype"], max_num_seqs=64, seed=0)
    load_s = time.perf_counter() - started
    params = SamplingParams(temperature=0.0, max_tokens=request["new_tokens"], ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in request["warmup"]], warm, use_tqdm=False)
    runs = {}
    for concurrency, prompts in request["runs"].items():
        t0 = time.perf_counter()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        wall = time.perf_counter() - t0
        ids = [list(o.outputs[0].token_ids) for o in outputs]
        runs[concurrency] = {"wall_s": wall, "output_tokens": sum(map(len, ids)), "outputs": ids}
    import vllm

    print(RESULT_PREFIX + json.dumps({"version": vllm.__version__, "load_s": load_s, "runs": runs}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
