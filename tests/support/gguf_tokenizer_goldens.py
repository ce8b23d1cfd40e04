"""Token ids llama.cpp gives for small fixed vocabularies, recorded once so `make test` checks shoal's
GGUF tokenizers against them without llama.cpp.

    .venv/bin/python -m tests.support.gguf_tokenizer_goldens    # re-record (needs `make peers`)

Recording trains the vocabularies (tests/support/gguf_vocab_files.py), writes each as a GGUF file,
runs llama.cpp on the corpus' fixed texts and stores the vocabularies (the byte-level one once, with
the pre-tokenizers it is written with) and llama.cpp's ids (BOS/EOS added, special tokens parsed, a
line of ids per text) in GOLDENS. The ids come from llama.cpp only, never from shoal.
"""

from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from tests.support.gguf_vocab_files import (
    VocabFile,
    byte_level_vocabularies,
    run_llama_cpp,
    sentencepiece_vocabularies,
    write_gguf,
)
from tests.support.tokenizer_corpus import FIXED

GOLDENS = Path(__file__).resolve().parent / "data" / "gguf_tokenizer_goldens.json"
SENTENCEPIECE = ("llama", "phi3", "gemma2", "gemma3")
PRES = ("llama-bpe", "qwen2", "smollm", "gpt-4o")
VOCAB_SIZE = 576


def load() -> tuple[list[str], list[tuple[VocabFile, list[list[int]]]]]:
    """(texts, [(vocabulary, llama.cpp's ids for each text)])."""
    state = json.loads(GOLDENS.read_text())
    shared = state["byte_level"]
    vocabularies = []
    for entry in state["vocabularies"]:
        if "pre" in entry:  # the shared byte-level vocabulary with one pre-tokenizer
            metadata = {**shared, "general.name": entry["name"], "tokenizer.ggml.pre": entry["pre"]}
            vocab = VocabFile(entry["name"], entry["architecture"], metadata)
        else:
            vocab = VocabFile.from_dict(entry)
        ids = [[int(i) for i in line.split()] for line in state["ids"][vocab.name]]
        vocabularies.append((vocab, ids))
    return state["texts"], vocabularies


def record(llama_cpp_python: Path) -> None:
    texts = list(FIXED)
    wanted = [v for v in sentencepiece_vocabularies(VOCAB_SIZE) if v.name in SENTENCEPIECE]
    byte_level = byte_level_vocabularies(list(PRES), vocab_size=2 * VOCAB_SIZE)
    shared = {k: v for k, v in byte_level[0].metadata.items() if k not in ("general.name", "tokenizer.ggml.pre")}
    entries = [v.to_dict() for v in wanted] + [
        {"name": v.name, "architecture": v.architecture, "pre": v.metadata["tokenizer.ggml.pre"]} for v in byte_level
    ]
    ids = {}
    with tempfile.TemporaryDirectory() as directory:
        for vocab in wanted + byte_level:
            path = write_gguf(vocab, Path(directory) / f"{vocab.name}.gguf")
            reference = run_llama_cpp(llama_cpp_python, path, texts)["ids"]
            ids[vocab.name] = [" ".join(map(str, pair[0])) for pair in reference]
    GOLDENS.parent.mkdir(exist_ok=True)
    lines = [
        "{",
        f' "texts": {_json(texts)},',
        f' "byte_level": {_json(shared)},',
        ' "vocabularies": [',
        ",\n".join(f"  {_json(entry)}" for entry in entries),
        " ],",
        ' "ids": {',
        ",\n".join(
            f"  {_json(name)}: [\n" + ",\n".join(f"   {_json(line)}" for line in rows) + "\n  ]"
            for name, rows in ids.items()
        ),
        " }",
        "}",
    ]
    GOLDENS.write_text("\n".join(lines) + "\n")


def _json(value) -> str:
    return json.dumps(value, ensure_ascii=False)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import peer_venv

    python = peer_venv.installed("llama-cpp")
    if python is None:
        sys.exit(peer_venv.failure("llama-cpp"))
    record(python)
    print(f"wrote {GOLDENS}")
