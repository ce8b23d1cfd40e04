"""GGUF files made the way llama.cpp makes them, from a Hugging Face directory: llama.cpp's own
`convert_hf_to_gguf.py` (the gguf-convert peer), then its quantizer (`llama_model_quantize`, in the
llama-cpp peer); and llama.cpp's logits and greedy tokens on such a file (llama_cpp_gguf.py).

Used by the GGUF goldens (tests/peers/test_gguf_goldens.py) and benchmarks/gguf_quant_speed.py.
Run inside the gguf-convert venv, it also trains a SentencePiece tokenizer:

    <gguf-convert venv>/bin/python benchmarks/gguf_files.py train-sentencepiece CORPUS PREFIX VOCAB
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from llama_cpp_gguf import RESULT_PREFIX
from peer_venv import llama_cpp_converter, python_of

RUNNER = Path(__file__).resolve().parent / "llama_cpp_gguf.py"
# The quantizer's file types the goldens and the speed benchmark use (llama.cpp's LLAMA_FTYPE_MOSTLY_*).
QUANT_TYPES = ("Q4_K_M", "Q5_K_M", "Q8_0", "IQ4_XS")


def convert(
    hf_dir: Path, out: Path, log: Callable[[str], None], outtype: str = "f16", base: Path | None = None
) -> Path:
    """`hf_dir` converted by llama.cpp's convert_hf_to_gguf.py to `out` (`outtype`: f16, bf16,
    f32, q8_0), or, given the `base` model's directory, the PEFT LoRA adapter in `hf_dir` by its
    convert_lora_to_gguf.py; raises RuntimeError with the converter's output if it fails."""
    python = python_of("gguf-convert", log)
    script = llama_cpp_converter(log, "convert_lora_to_gguf.py" if base else "convert_hf_to_gguf.py")
    done = subprocess.run(
        [str(python), str(script), str(hf_dir), "--outtype", outtype, "--outfile", str(out)]
        + (["--base", str(base)] if base else []),
        capture_output=True,
        text=True,
        check=False,
        cwd=script.parent,
        env={**os.environ, "PYTHONPATH": ""},
    )
    if done.returncode != 0 or not out.exists():
        raise RuntimeError(f"{script.name} failed on {hf_dir} ({done.returncode}): {done.stderr[-4000:]}")
    return out


def train_sentencepiece(corpus: Path, prefix: Path, vocab_size: int, log: Callable[[str], None]) -> Path:
    """A SentencePiece BPE model with byte fallback (the kind of Llama 2's, Mistral's, Phi-3's and
    Gemma's tokenizer.model) trained on `corpus`; returns PREFIX.model."""
    python = python_of("gguf-convert", log)
    done = subprocess.run(
        [str(python), __file__, "train-sentencepiece", str(corpus), str(prefix), str(vocab_size)],
        capture_output=True,
        text=True,
        check=False,
    )
    model = prefix.with_suffix(".model")
    if done.returncode != 0 or not model.exists():
        raise RuntimeError(f"training a SentencePiece model failed ({done.returncode}): {done.stderr[-4000:]}")
    return model


def run_llama_cpp(request: dict[str, Any], log: Callable[[str], None], timeout_s: float = 1800) -> dict[str, Any]:
    """One run of llama_cpp_gguf.py in the llama-cpp venv (see its docstring for the request)."""
    python = python_of("llama-cpp", log)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as file:
        json.dump(request, file)
        file.flush()
        done = subprocess.run(
            [str(python), str(RUNNER), file.name], capture_output=True, text=True, check=False, timeout=timeout_s
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"llama.cpp run failed ({done.returncode}): {done.stderr[-4000:]}")
    return json.loads(lines[-1].removeprefix(RESULT_PREFIX))


def quantize(source: Path, outputs: dict[str, Path], threads: int, log: Callable[[str], None]) -> dict[str, float]:
    """`source` quantized by llama.cpp to each {file type: path} of `outputs`, with the quantizer's
    defaults (no importance matrix); returns the seconds each took."""
    request = {"quantize": {"source": str(source), "outputs": {k: str(v) for k, v in outputs.items()}}}
    return run_llama_cpp({**request, "threads": threads}, log)["quantize"]


def main(argv: Sequence[str]) -> int:
    if len(argv) == 4 and argv[0] == "train-sentencepiece":
        import sentencepiece

        corpus, prefix, vocab = argv[1], argv[2], int(argv[3])
        sentencepiece.SentencePieceTrainer.train(
            input=corpus,
            model_prefix=prefix,
            vocab_size=vocab,
            model_type="bpe",
            byte_fallback=True,
            split_digits=True,
            character_coverage=1.0,
            num_threads=1,
            minloglevel=2,
        )
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
