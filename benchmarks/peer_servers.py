"""The command lines that start the peer engines' OpenAI servers on SmolLM2, one thread each, served
under one model name: used by the benchmarks and by `make test-peers` alike."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from vllm_peer import hf_directory

# vLLM's KV cache, in GiB (VLLM_CPU_KVCACHE_SPACE).
VLLM_ENVIRONMENT = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def llama_server_command(python: Path, gguf: Path, name: str, port: int) -> list[str]:
    """llama-cpp-python's server on the GGUF. It serves one request at a time, and by default ends the
    running stream early (a bare [DONE]) whenever another request arrives, a router's poll included:
    behind a router it runs with interrupt_requests off."""
    return [
        str(python),
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--model_alias",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_threads",
        "1",
        "--n_ctx",
        "2048",
        "--interrupt_requests",
        "false",
    ]


def vllm_server_command(python: Path, model: Path, name: str, port: int, log: Callable[[str], None]) -> list[str]:
    """vLLM's OpenAI server on `model`, a Hugging Face directory or a GGUF converted to one
    (vllm_peer.py), bf16; run with VLLM_ENVIRONMENT. Its `vllm` command fails under the vllm-cpu distribution (it looks up the
    version of a package named vllm), so the server module is run instead."""
    return [
        str(python),
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model if model.is_dir() else hf_directory(model, log)),
        "--served-model-name",
        name,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--max-model-len",
        "2048",
        "--dtype",
        "bfloat16",
    ]
