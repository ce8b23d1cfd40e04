"""llama.cpp (llama-cpp-python) quantizing GGUF files and computing logits on them, run inside its
own venv (see gguf_files.py):

    <llama-cpp venv>/bin/python benchmarks/llama_cpp_gguf.py REQUEST.json

REQUEST.json: {"threads": N, and either or both of
- "quantize": {"source": F16_GGUF, "outputs": {"Q4_K_M": PATH, ...}}: each file type written by
  `llama_model_quantize` with its default parameters (no importance matrix);
- "evaluate": [{"gguf", "prompt": [ids], "new_tokens": N, "logits": NPY_PATH, "text": STR}, ...]:
  N greedy tokens after the prompt (argmax of each step's logits, one token a step), then the logits
  of every position of prompt + those tokens, computed in one batch (`logits_all`), saved as float32
  (positions x vocab) to NPY_PATH; and `text` as the file's tokenizer splits it (no BOS, no special
  tokens parsed)}.
Prints one line `LLAMA_GGUF_RESULT <json>`: {"quantize": {type: seconds}, "evaluate": [{"greedy":
[ids], "text_ids": [ids]}], "version"}. Imports llama-cpp-python, numpy and the standard library only.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

RESULT_PREFIX = "LLAMA_GGUF_RESULT "


def quantize(request: dict[str, Any], threads: int) -> dict[str, float]:
    import llama_cpp as lc

    seconds = {}
    for file_type, path in request["outputs"].items():
        params = lc.llama_model_quantize_default_params()
        params.ftype = getattr(lc, f"LLAMA_FTYPE_MOSTLY_{file_type}")
        params.nthread = threads
        start = time.perf_counter()
        status = lc.llama_model_quantize(request["source"].encode(), path.encode(), params)
        if status != 0:
            raise RuntimeError(f"llama_model_quantize to {file_type} returned {status}")
        seconds[file_type] = time.perf_counter() - start
    return seconds


def evaluate(item: dict[str, Any], threads: int) -> dict[str, Any]:
    import llama_cpp as lc
    import numpy as np

    prompt, count = list(item["prompt"]), item["new_tokens"]
    length = len(prompt) + count
    llm = lc.Llama(
        model_path=item["gguf"],
        logits_all=True,
        n_ctx=length + 16,
        n_batch=length + 16,
        n_ubatch=length + 16,
        n_threads=threads,
        n_threads_batch=threads,
        seed=0,
        verbose=False,
    )
    llm.eval(prompt)
    greedy: list[int] = []
    for _ in range(count):
        token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(token)
        llm.eval([token])
    llm.reset()
    llm.eval(prompt + greedy)
    np.save(item["logits"], np.asarray(llm.scores[:length], dtype=np.float32))
    text_ids = llm.tokenize(item["text"].encode(), add_bos=False, special=False) if item.get("text") else []
    return {"greedy": greedy, "text_ids": list(text_ids)}


def main(path: str) -> None:
    import llama_cpp

    request = json.loads(open(path).read())
    threads = request["threads"]
    result: dict[str, Any] = {"version": llama_cpp.__version__}
    if "quantize" in request:
        result["quantize"] = quantize(request["quantize"], threads)
    if "evaluate" in request:
        result["evaluate"] = [evaluate(item, threads) for item in request["evaluate"]]
    print(RESULT_PREFIX + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
