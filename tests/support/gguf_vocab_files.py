"""Small GGUF files that hold a tokenizer (and one tensor, so every reader opens them), written the
way llama.cpp's converter (convert_hf_to_gguf.py) writes each architecture's vocabulary, for
comparing shoal's tokenizer with llama.cpp's.

SentencePiece vocabularies are trained here with the `sentencepiece` package (BPE with byte fallback
and split digits, as Llama 2's, Mistral's, Phi-3's and Gemma's are) on README.md and the tokenizer
corpus, then typed as the converter types them: the model's unknown, control and byte pieces keep
their kind and its user-defined pieces become normal tokens; tokens the Hugging Face tokenizer adds
are control tokens when special, else user-defined ones (score -1000; for Gemma with U+2581 written
back as a space).
- "llama" (Llama 2): <unk> <s> </s>, a space prefix, BOS added; a few normal tokens sharing one
  score, so ties are broken by position.
- "mistral" (architecture llama): control tokens [INST] [/INST] [TOOL_CALLS], and EOS added too.
- "phi3": the vocabulary padded with unused [PADn] tokens, then <|endoftext|>, <|assistant|>,
  <|user|>, <|end|>, ... added; named "Phi3", which makes llama.cpp strip whitespace after special
  tokens; "phi3-5" is the same vocabulary named "Phi 3.5 Mini Instruct", which does not.
- "gemma2": <pad> <eos> <bos> <unk> <mask> [@BOS@] <unusedN> <start_of_turn> <end_of_turn>, no
  space prefix, runs of newlines, spaces and tabs as user-defined tokens.
- "gemma3": the same ids, whitespace runs left as normal ▁-pieces, HTML tags user-defined.
Byte-level BPE vocabularies ("gpt2") are trained with `tokenizers` (GPT-2's byte-level BPE) and
written once for each `tokenizer.ggml.pre`, with control tokens, user-defined tokens in raw text
("    ", "ö", "ú", "<tool>") and a few tokens no merge makes (what llama.cpp's `ignore_merges` reaches).
"""

from __future__ import annotations

import io
import json
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from shoal.model.gguf_backend import bytes_to_unicode
from tests.support.tokenizer_corpus import FIXED

README = Path(__file__).resolve().parents[2] / "README.md"
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
_EMBEDDING = 8


@dataclass
class VocabFile:
    """One test vocabulary: its name, GGUF architecture and `tokenizer.*`/`general.name` metadata."""

    name: str
    architecture: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "architecture": self.architecture, "metadata": self.metadata}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> VocabFile:
        return cls(state["name"], state["architecture"], dict(state["metadata"]))


def write_gguf(vocab: VocabFile, path: Path) -> Path:
    """`vocab` as a GGUF file llama.cpp can open with vocab_only (minimal hyperparameters) and shoal
    with its loader (a token embedding tensor)."""
    writer = gguf.GGUFWriter(str(path), vocab.architecture)
    writer.add_context_length(64)
    writer.add_embedding_length(_EMBEDDING)
    writer.add_block_count(1)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(1)
    writer.add_layer_norm_rms_eps(1e-6)
    for key, value in vocab.metadata.items():
        if key == "tokenizer.ggml.scores":
            writer.add_array(key, [float(v) for v in value])
        elif key == "tokenizer.ggml.token_type":
            writer.add_token_types([int(v) for v in value])
        elif isinstance(value, list):
            writer.add_array(key, value)
        elif isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        else:
            writer.add_string(key, value)
    n_tokens = len(vocab.metadata["tokenizer.ggml.tokens"])
    writer.add_tensor("token_embd.weight", np.zeros((n_tokens, _EMBEDDING), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def training_lines() -> list[str]:
    """README.md and the corpus' fixed texts, a line each (SentencePiece trains on lines)."""
    text = README.read_text() + "\n" + "\n".join(FIXED)
    return [line for line in text.split("\n") if line.strip()]


def _sentencepiece(vocab_size: int, **options: Any) -> list[tuple[str, float, int]]:
    """(piece, score, GGUF token type as the converter sets it) of a freshly trained model."""
    import sentencepiece

    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(training_lines()),
        model_writer=model,
        model_type="bpe",
        vocab_size=vocab_size,
        byte_fallback=True,
        split_digits=True,
        character_coverage=0.9995,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        allow_whitespace_only_pieces=True,
        num_threads=1,
        minloglevel=2,
        **options,
    )
    processor = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())
    pieces = []
    for i in range(processor.vocab_size()):
        kind = NORMAL
        if processor.IsUnknown(i):
            kind = UNKNOWN
        elif processor.IsControl(i):
            kind = CONTROL
        elif processor.IsUnused(i):
            kind = UNUSED
        elif processor.IsByte(i):
            kind = BYTE
        pieces.append((processor.IdToPiece(i), float(processor.GetScore(i)), kind))
    return pieces


def _spm_metadata(pieces: list[tuple[str, float, int]], name: str, **keys: Any) -> dict[str, Any]:
    return {
        "general.name": name,
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": [p[0] for p in pieces],
        "tokenizer.ggml.scores": [p[1] for p in pieces],
        "tokenizer.ggml.token_type": [p[2] for p in pieces],
        **{f"tokenizer.ggml.{k}": v for k, v in keys.items()},
    }


def _tied(pieces: list[tuple[str, float, int]]) -> list[tuple[str, float, int]]:
    """Normal tokens made of pairs of existing ones, all with one score (the median normal score)."""
    texts = {p[0] for p in pieces}
    normal = sorted(p[1] for p in pieces if p[2] == NORMAL and len(p[0]) > 1)
    score = normal[len(normal) // 2]
    extra = []
    for word in ("▁hello", "▁world", "▁tokens", "▁the", "ing", "tion", "▁code", "ers"):
        for i in range(1, len(word)):
            for candidate in (word[:i], word[i:]):
                if len(candidate) > 1 and candidate not in texts:
                    texts.add(candidate)
                    extra.append((candidate, score, NORMAL))
    return pieces + extra


def sentencepiece_vocabularies(vocab_size: int = 640) -> list[VocabFile]:
    """The SentencePiece vocabularies described in the module docstring."""
    llama_pieces = _tied(_sentencepiece(vocab_size, unk_id=0, bos_id=1, eos_id=2, pad_id=-1, add_dummy_prefix=True))
    llama = VocabFile(
        "llama",
        "llama",
        _spm_metadata(llama_pieces, "Llama 2 Test", bos_token_id=1, eos_token_id=2, unknown_token_id=0),
    )
    mistral_pieces = _sentencepiece(
        vocab_size,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        add_dummy_prefix=True,
        control_symbols=["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]"],
    )
    mistral = VocabFile(
        "mistral",
        "llama",
        _spm_metadata(
            mistral_pieces,
            "Mistral Test",
            bos_token_id=1,
            eos_token_id=2,
            unknown_token_id=0,
            add_bos_token=True,
            add_eos_token=True,
            add_space_prefix=True,
        ),
    )
    phi_pieces = list(llama_pieces)
    phi_pieces += [(f"[PAD{i}]", -10000.0, UNUSED) for i in range(len(phi_pieces), len(phi_pieces) + 24)]
    added = [
        "<|endoftext|>",
        "<|assistant|>",
        "<|placeholder1|>",
        "<|placeholder2|>",
        "<|system|>",
        "<|end|>",
        "<|placeholder3|>",
        "<|user|>",
    ]
    endoftext = len(phi_pieces)
    phi_pieces += [(text, -1000.0, CONTROL) for text in added] + [("<|placeholder4|>", -1000.0, USER_DEFINED)]
    phi_keys = dict(bos_token_id=1, eos_token_id=endoftext, unknown_token_id=0, padding_token_id=endoftext)
    phi3 = VocabFile("phi3", "phi3", _spm_metadata(phi_pieces, "Phi3", add_bos_token=False, **phi_keys))
    phi35 = VocabFile("phi3-5", "phi3", _spm_metadata(phi_pieces, "Phi 3.5 Mini Instruct", **phi_keys))

    controls = ["<mask>", "[@BOS@]", *(f"<unused{i}>" for i in range(6)), "<start_of_turn>", "<end_of_turn>"]
    newlines = ["\n" * k for k in range(1, 9)]
    spaces = ["▁" * k for k in range(2, 17)]
    tabs = ["\t" * k for k in range(1, 5)]
    html = ["<table>", "<tr>", "<td>", "</td>", "</tr>", "</table>", "<h1>", "</h1>", "<br>"]
    gemma_ids = dict(
        unk_id=3,
        bos_id=2,
        eos_id=1,
        pad_id=0,
        bos_piece="<bos>",
        eos_piece="<eos>",
        pad_piece="<pad>",
        add_dummy_prefix=False,
        control_symbols=controls,
    )
    gemma_keys = dict(bos_token_id=2, eos_token_id=1, unknown_token_id=3, padding_token_id=0, add_space_prefix=False)
    gemma2_pieces = _sentencepiece(vocab_size, user_defined_symbols=newlines + spaces + tabs, **gemma_ids)
    added_text = set(newlines + spaces + tabs)
    gemma2_pieces = [
        (text.replace("▁", " "), -1000.0, USER_DEFINED) if text in added_text else (text, score, kind)
        for text, score, kind in gemma2_pieces
    ]
    gemma2 = VocabFile("gemma2", "gemma2", _spm_metadata(gemma2_pieces, "Gemma 2 Test", **gemma_keys))
    gemma3_pieces = _sentencepiece(
        vocab_size,
        user_defined_symbols=newlines + spaces + tabs + html,
        **{**gemma_ids, "control_symbols": [*controls, "<start_of_image>", "<end_of_image>"]},
    )
    gemma3_pieces = [
        (text, -1000.0, USER_DEFINED) if text in html or text in newlines else (text, score, kind)
        for text, score, kind in gemma3_pieces
    ]
    gemma3 = VocabFile("gemma3", "gemma3", _spm_metadata(gemma3_pieces, "Gemma 3 Test", **gemma_keys))
    return [llama, mistral, phi3, phi35, gemma2, gemma3]


def byte_level_pieces(vocab_size: int = 1024) -> dict[str, Any]:
    """tokens, types and merges of a byte-level BPE trained here (GPT-2's pre-tokenizer), with
    control tokens, raw-text user-defined tokens and tokens no merge makes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    controls = ["<|endoftext|>", "<|begin_of_text|>", "<|im_start|>", "<|im_end|>"]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=controls,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_lines(), trainer)
    model = json.loads(tokenizer.to_str())["model"]
    vocab = model["vocab"]
    # Bytes F5-FF never occur in UTF-8; like DeepSeek's, this vocabulary leaves them out and has
    # user-defined tokens spelled with their characters (ö, ú).
    never = {bytes_to_unicode()[b] for b in range(0xF5, 0x100)}
    tokens = [text for text, _ in sorted(vocab.items(), key=lambda item: item[1]) if text not in never]
    types = [CONTROL if text in controls else NORMAL for text in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    for word in (" Việt", " unreachable", " Greeter"):
        spelled = _byte_level(word)
        if spelled not in vocab:
            tokens.append(spelled)
            types.append(NORMAL)
    for text in ("    ", "ö", "ú", "<tool>"):
        tokens.append(text)
        types.append(USER_DEFINED)
    return {"tokens": tokens, "types": types, "merges": merges, "controls": controls}


def _byte_level(text: str) -> str:
    table = bytes_to_unicode()
    return "".join(table[b] for b in text.encode())


def byte_level_vocabularies(pres: list[str], vocab_size: int = 1024) -> list[VocabFile]:
    """One "gpt2" vocabulary per `tokenizer.ggml.pre` in `pres` (None: the key left out)."""
    pieces = byte_level_pieces(vocab_size)
    tokens = pieces["tokens"]
    files = []
    for pre in pres:
        metadata = {
            "general.name": f"BPE Test {pre}",
            "tokenizer.ggml.model": "gpt2",
            **({"tokenizer.ggml.pre": pre} if pre is not None else {}),
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": pieces["types"],
            "tokenizer.ggml.merges": pieces["merges"],
            "tokenizer.ggml.bos_token_id": tokens.index("<|begin_of_text|>"),
            "tokenizer.ggml.eos_token_id": tokens.index("<|endoftext|>"),
        }
        files.append(VocabFile(f"gpt2-{pre or 'no-pre'}", "llama", metadata))
    return files


LLAMA_CPP_TOKENS = Path(__file__).resolve().parent / "llama_cpp_tokens.py"


def run_llama_cpp(python: Path, gguf_path: Path, texts: list[str], detokenize=(), pieces: bool = False) -> dict:
    """llama.cpp's ids (and texts, pieces) for `gguf_path`, from llama_cpp_tokens.py run by `python`
    (the llama-cpp peer's)."""
    request = {"gguf": str(gguf_path), "texts": texts, "detokenize": list(detokenize), "pieces": pieces}
    done = subprocess.run(
        [str(python), str(LLAMA_CPP_TOKENS)], input=json.dumps(request), capture_output=True, text=True, timeout=600
    )
    if done.returncode != 0:
        raise RuntimeError(f"llama_cpp_tokens.py failed on {gguf_path} ({done.returncode}): {done.stderr[-3000:]}")
    return json.loads(done.stdout)


# `tokenizer.ggml.pre` values for which llama.cpp's detokenizer leaves spaces as they are; for the
# other byte-level ones it cleans them up (llama_vocab::impl::detokenize, `clean_spaces`).
KEEPS_SPACES = frozenset(
    "afmoe bailingmoe bailingmoe2 chameleon cohere2moe command-r deepseek-coder deepseek-llm deepseek-r1-qwen "
    "deepseek-v3 f2llmv2 gpt-4o granite-docling granite-embed-multi-97m grok-2 hunyuan hunyuan-dense hy_v4 "
    "joyai-llm kanana2 kimi-k2 kormo laguna llada-moe llama4 minimax-m2 poro-chat qwen2 qwen35 sarvam-moe "
    "seed-coder smollm solar-open spark2_5 superbpe talkie tekken tiny_aya trillion ufakzeka viking youtu".split()
)


def llama_cpp_clean_spaces(text: str, vocab: VocabFile) -> str:
    """`text` as llama.cpp's detokenizer leaves it for `vocab`: for a byte-level vocabulary whose
    pre-tokenizer is not in KEEPS_SPACES, its three in-place passes (no space before ? ! . , ; none
    around a lone apostrophe; none before 's 'm 're 've), replayed character by character."""
    if vocab.metadata["tokenizer.ggml.model"] != "gpt2" or vocab.metadata.get("tokenizer.ggml.pre") in KEEPS_SPACES:
        return text
    t = list(text)
    n = len(t)
    total = 1 if n else 0
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == " " and x in "?!.,":
            total -= 1
        t[total] = x
        total += 1
    n, total, i = total, 1 if total else 0, 1
    while i < n:
        x = t[i]
        if x == "'" and i + 1 < n and t[i - 1] == " " and t[i + 1] == " ":
            total -= 1
            i += 1
            t[i] = "\0"
        t[total] = x
        total += 1
        i += 1
    n, total = total, 1 if total else 0
    for i in range(1, n):
        x = t[i]
        if t[i - 1] == " " and x == "'" and i + 1 < n:
            x1 = t[i + 1]
            if x1 in "sm" or (i + 2 < n and (x1, t[i + 2]) in (("r", "e"), ("v", "e"))):
                total -= 1
        t[total] = x
        total += 1
    return "".join(t[:total])
