"""llama.cpp's tokenizer on a GGUF file, run with the python of the llama-cpp peer venv
(tests.support.peer_engines.peer_python("llama-cpp")); it imports nothing from shoal.

Reads one JSON object on stdin: {"gguf": path, "texts": [str], "detokenize": [[id]], "pieces": bool},
and writes {"ids": [[add_special=true ids, add_special=false ids] per text, special tokens parsed],
"text": [[remove_special+hide specials, keep+show specials] per id list], "pieces": [[hidden, shown]
hex bytes of each token's piece] (when asked), "n_tokens": int}.
Text goes through as UTF-8 (surrogates escaped with surrogatepass); detokenized text comes back as
lists of byte values so invalid UTF-8 survives the trip.
"""

from __future__ import annotations

import ctypes
import json
import sys

import llama_cpp


def _tokenize(vocab, data: bytes, add_special: bool) -> list[int]:
    capacity = len(data) + 8
    while True:
        buffer = (llama_cpp.llama_token * capacity)()
        n = llama_cpp.llama_tokenize(vocab, data, len(data), buffer, capacity, add_special, True)
        if n >= 0:
            return list(buffer[:n])
        if -n <= capacity:
            raise RuntimeError(f"llama_tokenize failed ({n}) on {data!r}")
        capacity = -n


def _detokenize(vocab, ids: list[int], remove_special: bool, unparse_special: bool) -> list[int]:
    tokens = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
    capacity = 64 + 64 * len(ids)
    buffer = ctypes.create_string_buffer(capacity)
    n = llama_cpp.llama_detokenize(vocab, tokens, len(ids), buffer, capacity, remove_special, unparse_special)
    if n < 0:
        raise RuntimeError(f"llama_detokenize needs {-n} bytes")
    return list(buffer.raw[:n])


def _piece(vocab, token: int, special: bool) -> str:
    buffer = ctypes.create_string_buffer(256)
    n = llama_cpp.llama_token_to_piece(vocab, token, buffer, 256, 0, special)
    if n < 0:
        buffer = ctypes.create_string_buffer(-n)
        n = llama_cpp.llama_token_to_piece(vocab, token, buffer, -n, 0, special)
    return buffer.raw[:n].hex()


def main() -> int:
    request = json.load(sys.stdin)
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(request["gguf"].encode(), params)
    if not model:
        print(f"llama.cpp could not load {request['gguf']}", file=sys.stderr)
        return 1
    vocab = llama_cpp.llama_model_get_vocab(model)
    ids = []
    for text in request.get("texts", []):
        data = text.encode("utf-8", "surrogatepass")
        ids.append([_tokenize(vocab, data, True), _tokenize(vocab, data, False)])
    texts = [
        [_detokenize(vocab, token_ids, True, False), _detokenize(vocab, token_ids, False, True)]
        for token_ids in request.get("detokenize", [])
    ]
    n_tokens = llama_cpp.llama_vocab_n_tokens(vocab)
    pieces = (
        [[_piece(vocab, i, False), _piece(vocab, i, True)] for i in range(n_tokens)] if request.get("pieces") else []
    )
    json.dump({"ids": ids, "text": texts, "pieces": pieces, "n_tokens": n_tokens}, sys.stdout)
    llama_cpp.llama_model_free(model)
    return 0


if __name__ == "__main__":
    sys.exit(main())
