"""GGUF goldens against llama.cpp: for each model family shoal runs, a small random model built with
transformers' config class, converted by llama.cpp's own convert_hf_to_gguf.py, quantized by
llama.cpp's quantizer, and run by both engines on the same files (benchmarks/gguf_files.py).

Tokenizers the converter accepts: the families whose models ship SentencePiece tokenizers (Mistral,
Phi-3, Gemma 2 and 3) get a SentencePiece BPE model trained here on README.md (tokenizer.model, the
converter's llama-style vocab); the others get SmolLM2's byte-level BPE tokenizer, rebuilt by
transformers from the bundled SmolLM2 GGUF, whose pre-tokenizer the converter knows by its hash
("smollm"). OLMo 2's converter takes a BPE tokenizer.json only.
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
if str(BENCHMARKS) not in sys.path:
    sys.path.insert(0, str(BENCHMARKS))

import gguf_files  # noqa: E402  (benchmarks/ holds the converter's and quantizer's runs)

README = Path(__file__).resolve().parents[2] / "README.md"
SENTENCEPIECE_VOCAB = 512
SMOLLM2_VOCAB = 49152
# A text both engines tokenize, to report whether shoal reads each file's tokenizer as llama.cpp does.
TOKENIZER_TEXT = "Hello world!  Two  spaces, tabs\tand\nnew lines; digits 12345, unicode café 日本 🐟, code: x = f(y)"

# K-quants and IQ4_XS pack 256 columns a block: hidden sizes are multiples of 256. An MLP of 384
# (Mistral, Qwen2, OLMo 2, Phi-3, Gemma 2) gives ffn_down 384 columns, which llama.cpp's quantizer
# stores in its fallback types (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, IQ4_XS -> IQ4_NL).
COMMON = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    bos_token_id=1,
    eos_token_id=2,
    rms_norm_eps=1e-6,
)
WINDOW = 32  # shorter than every prompt


@dataclass(frozen=True)
class FamilyModel:
    """A family's test model: transformers' config and model class, its config fields beyond
    COMMON, its tokenizer ("sentencepiece" or "smollm2"), and the quantizer's file types of its own
    beyond gguf_files.QUANT_TYPES (gpt-oss's MXFP4_MOE)."""

    config_class: str
    model_class: str
    fields: dict[str, Any]
    tokenizer: str
    own_types: tuple[str, ...] = ()


FAMILIES = {
    # Llama 3.2's shape: tied embeddings (token_embd is then the output too), Llama 3 RoPE scaling
    # (the converter writes rope_freqs), GQA 4 (IQ4_XS gives attn_v Q5_K).
    "llama": FamilyModel(
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(
            num_attention_heads=8,
            head_dim=32,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
        "smollm2",
    ),
    # The converter writes Mistral as a llama GGUF without its sliding window, and llama.cpp's llama
    # architecture has none: both engines attend to the whole prompt on this file.
    "mistral": FamilyModel(
        "MistralConfig",
        "MistralForCausalLM",
        dict(intermediate_size=384, sliding_window=WINDOW, tie_word_embeddings=False),
        "sentencepiece",
    ),
    "qwen2": FamilyModel(
        "Qwen2Config", "Qwen2ForCausalLM", dict(intermediate_size=384, tie_word_embeddings=False), "smollm2"
    ),
    "qwen3": FamilyModel("Qwen3Config", "Qwen3ForCausalLM", dict(tie_word_embeddings=True), "smollm2"),
    # RoPE left out of layer 3 (every fourth, as llama.cpp takes it).
    "smollm3": FamilyModel(
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        dict(no_rope_layer_interval=4, pad_token_id=0, tie_word_embeddings=True),
        "smollm2",
    ),
    "granite": FamilyModel(
        "GraniteConfig",
        "GraniteForCausalLM",
        dict(
            embedding_multiplier=12.0,
            residual_multiplier=0.22,
            attention_multiplier=0.125,
            logits_scaling=2.0,
            tie_word_embeddings=True,
        ),
        "smollm2",
    ),
    "olmo2": FamilyModel("Olmo2Config", "Olmo2ForCausalLM", dict(intermediate_size=384, pad_token_id=0), "smollm2"),
    # Phi-3.5's longrope; the engines serve 256 positions of the original 512, so both take the
    # short factors. llama.cpp turns Phi-3's sliding window off; this model has none.
    "phi3": FamilyModel(
        "Phi3Config",
        "Phi3ForCausalLM",
        dict(
            intermediate_size=384,
            pad_token_id=0,
            sliding_window=None,
            max_position_embeddings=2048,
            original_max_position_embeddings=512,
            rope_scaling={
                "rope_type": "longrope",
                "short_factor": [1.0 + 0.05 * i for i in range(32)],
                "long_factor": [2.0 + 0.25 * i for i in range(32)],
            },
            tie_word_embeddings=False,
        ),
        "sentencepiece",
    ),
    # A window on layers 0 and 2; soft caps low enough to bite on these logits.
    "gemma2": FamilyModel(
        "Gemma2Config",
        "Gemma2ForCausalLM",
        dict(
            intermediate_size=384,
            sliding_window=WINDOW,
            query_pre_attn_scalar=64,
            attn_logit_softcapping=10.0,
            final_logit_softcapping=5.0,
        ),
        "sentencepiece",
    ),
    # Five window layers to one global, as llama.cpp's default pattern (the converter writes none).
    "gemma3": FamilyModel(
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(num_hidden_layers=6, sliding_window=WINDOW, query_pre_attn_scalar=64),
        "sentencepiece",
    ),
    # 8 experts, top-2: the converter writes a llama file with stacked expert tensors.
    "mixtral": FamilyModel(
        "MixtralConfig",
        "MixtralForCausalLM",
        dict(num_local_experts=8, num_experts_per_tok=2, sliding_window=None, tie_word_embeddings=False),
        "sentencepiece",
    ),
    # 4 experts of 256, top-2 (softmax of the best logits), attention sinks, a window of 32 on even
    # layers, YaRN, biases everywhere; the experts as the converter writes bf16 ones (F16, then each
    # quantization).
    "gpt_oss": FamilyModel(
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(
            intermediate_size=256,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=WINDOW,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": True,
                "original_max_position_embeddings": 256,
                "rope_theta": 150000.0,
            },
        ),
        "smollm2",
        own_types=("MXFP4_MOE",),
    ),
    # 8 experts of 256, top-4 renormalised.
    "qwen3_moe": FamilyModel(
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(num_experts=8, num_experts_per_tok=4, moe_intermediate_size=256, norm_topk_prob=True),
        "smollm2",
    ),
}


def _log(message: str) -> None:
    print(message, file=sys.stderr)


def sentencepiece_model(cache: Path) -> Path:
    """The SentencePiece BPE model (SENTENCEPIECE_VOCAB pieces, byte fallback) trained on README.md,
    once per cache directory."""
    model = cache / "spm" / "tokenizer.model"
    if not model.exists():
        model.parent.mkdir(parents=True, exist_ok=True)
        trained = gguf_files.train_sentencepiece(README, model.parent / "trained", SENTENCEPIECE_VOCAB, _log)
        trained.rename(model)
    return model


def smollm2_tokenizer(cache: Path) -> Path:
    """A directory holding SmolLM2's tokenizer.json, rebuilt by transformers from the bundled GGUF,
    once per cache directory."""
    directory = cache / "smollm2-tokenizer"
    if not (directory / "tokenizer.json").exists():
        import transformers

        from shoal.model.registry import resolve_model

        gguf = Path(resolve_model("smollm2-135m-instruct").path)
        tokenizer = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        tokenizer.save_pretrained(str(directory))
    return directory


def write_tokenizer(directory: Path, kind: str, cache: Path) -> int:
    """The family's tokenizer files in `directory`; returns the vocabulary size."""
    if kind == "sentencepiece":
        shutil.copy(sentencepiece_model(cache), directory / "tokenizer.model")
        config = {
            "tokenizer_class": "LlamaTokenizer",
            "bos_token": "<s>",
            "eos_token": "</s>",
            "unk_token": "<unk>",
            "add_bos_token": True,
            "add_eos_token": False,
        }
        (directory / "tokenizer_config.json").write_text(json.dumps(config))
        return SENTENCEPIECE_VOCAB
    shutil.copy(smollm2_tokenizer(cache) / "tokenizer.json", directory / "tokenizer.json")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "pad_token": "<|im_end|>",
        "add_bos_token": False,
    }
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return SMOLLM2_VOCAB


def write_family_model(name: str, directory: Path, cache: Path, std: float = 0.2) -> Path:
    """A Hugging Face directory of family `name`'s random model (weights N(0, std), seeded) and its
    tokenizer."""
    import transformers

    spec = FAMILIES[name]
    directory.mkdir(parents=True, exist_ok=True)
    vocab = write_tokenizer(directory, spec.tokenizer, cache)
    config = getattr(transformers, spec.config_class)(**{**COMMON, "vocab_size": vocab, **spec.fields})
    torch.manual_seed(11)
    model = getattr(transformers, spec.model_class)(config).eval()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_(0, std)
    model.save_pretrained(directory)
    return directory


@dataclass
class LlamaCppRun:
    """llama.cpp on one GGUF file: its greedy tokens after the prompt, the logits of every position
    of prompt + those tokens, how its tokenizer splits TOKENIZER_TEXT, and the file's tensor types."""

    gguf: Path
    greedy: list[int]
    logits: np.ndarray
    text_ids: list[int]
    tensor_types: dict[str, int] = field(default_factory=dict)


@dataclass
class FamilyFiles:
    """A family's files (F16 from the converter, then each quantization) and llama.cpp's runs."""

    name: str
    hf_dir: Path
    prompt: list[int]
    runs: dict[str, LlamaCppRun]
    quantize_s: dict[str, float]


def prompt_ids(vocab: int, length: int, seed: int = 5) -> list[int]:
    """`length` token ids drawn from the vocabulary past its first 3 (unknown, BOS, EOS)."""
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(length)]


def tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each ggml type the file holds."""
    from shoal.model.gguf_header import read_gguf_header

    counts: dict[str, int] = {}
    for tensor in read_gguf_header(path).tensors:
        counts[tensor.type_name] = counts.get(tensor.type_name, 0) + 1
    return dict(sorted(counts.items()))


def make_family_files(
    name: str, root: Path, cache: Path, prompt_length: int, new_tokens: int, threads: int
) -> FamilyFiles:
    """Family `name`'s model converted to F16 and quantized to each of gguf_files.QUANT_TYPES and its
    own types, and llama.cpp's run on every file (one process for the conversion, one for
    quantizing and running)."""
    hf_dir = write_family_model(name, root / "hf", cache)
    f16 = gguf_files.convert(hf_dir, root / f"{name}-F16.gguf", _log)
    quantized = (*gguf_files.QUANT_TYPES, *FAMILIES[name].own_types)
    files = {"F16": f16, **{kind: root / f"{name}-{kind}.gguf" for kind in quantized}}
    vocab = SENTENCEPIECE_VOCAB if FAMILIES[name].tokenizer == "sentencepiece" else SMOLLM2_VOCAB
    prompt = prompt_ids(vocab, prompt_length)
    request = {
        "threads": threads,
        "quantize": {"source": str(f16), "outputs": {k: str(files[k]) for k in quantized}},
        "evaluate": [
            {
                "gguf": str(path),
                "prompt": prompt,
                "new_tokens": new_tokens,
                "logits": str(path.with_suffix(".logits.npy")),
                "text": TOKENIZER_TEXT,
            }
            for path in files.values()
        ],
    }
    result = gguf_files.run_llama_cpp(request, _log)
    runs = {
        kind: LlamaCppRun(
            path, item["greedy"], np.load(path.with_suffix(".logits.npy")), item["text_ids"], tensor_types(path)
        )
        for (kind, path), item in zip(files.items(), result["evaluate"])
    }
    return FamilyFiles(name, hf_dir, prompt, runs, result["quantize"])


@dataclass
class Agreement:
    """shoal against llama.cpp on one file: the largest and mean |logit difference| over every
    position of prompt + llama.cpp's greedy tokens (and the spread of llama.cpp's logits, for scale);
    at how many of those greedy positions shoal's argmax is llama.cpp's token (fed llama.cpp's
    tokens: `teacher_forced`), and how many of shoal's own greedy tokens equal llama.cpp's before the
    first that differs (`greedy_prefix`); whether shoal's tokenizer of the file splits
    TOKENIZER_TEXT as llama.cpp's does (None: shoal did not load it, `tokenizer_error` says why)."""

    family: str
    kind: str
    max_abs: float
    mean_abs: float
    logit_std: float
    teacher_forced: int
    greedy_prefix: int
    new_tokens: int
    tokenizer_equal: bool | None
    tokenizer_error: str | None = None

    def line(self) -> str:
        tokenizer = {True: "same ids", False: "other ids", None: f"not read ({self.tokenizer_error})"}
        return (
            f"{self.family:8s} {self.kind:7s} max|d| {self.max_abs:7.4f}  mean|d| {self.mean_abs:7.5f}  "
            f"(logit std {self.logit_std:5.3f})  greedy {self.teacher_forced:2d}/{self.new_tokens} fed, "
            f"{self.greedy_prefix:2d}/{self.new_tokens} free  tokenizer: {tokenizer[self.tokenizer_equal]}"
        )


# Every comparison of this run, for the summary at its end (tests/peers/conftest.py).
RESULTS: list[Agreement] = []


def shoal_engine(gguf: Path, cache_dir: Path, threads: int, keep_quantized: bool = True):
    """shoal's offline engine on a GGUF file: float32 activations, its native kernels on the
    quantized matrices (unless keep_quantized=False: every tensor dequantized by gguf-py)."""
    from shoal import LLM

    return LLM(
        str(gguf),
        dtype="float32",
        device="cpu",
        kv_cache_bytes=16 << 20,
        max_model_len=256,
        cache_dir=str(cache_dir),
        num_threads=threads,
        keep_quantized=keep_quantized,
    )


def compare(family: str, kind: str, run: LlamaCppRun, prompt: list[int], cache_dir: Path, threads: int) -> Agreement:
    """shoal's logits and greedy tokens on `run`'s file against llama.cpp's."""
    from shoal import SamplingParams
    from tests.support.logits import forward_logits

    llm = shoal_engine(run.gguf, cache_dir, threads)
    try:
        sequence = prompt + run.greedy
        with torch.no_grad():
            logits = forward_logits(llm, sequence).float().numpy()
        difference = np.abs(logits - run.logits)
        fed = logits[len(prompt) - 1 : -1].argmax(-1)
        teacher_forced = int((fed == np.asarray(run.greedy)).sum())
        params = SamplingParams(temperature=0, max_tokens=len(run.greedy), ignore_eos=True)
        own = llm.generate([prompt], params)[0].outputs[0].token_ids
        prefix = next((i for i, (a, b) in enumerate(zip(own, run.greedy)) if a != b), len(run.greedy))
        try:
            ids = llm.get_tokenizer().encode(TOKENIZER_TEXT, add_special_tokens=False)
            tokenizer_equal, error = list(ids) == run.text_ids, None
        except Exception as exc:  # reported, not failed: the tokenizer is another test's subject
            tokenizer_equal, error = None, f"{type(exc).__name__}: {exc}"
    finally:
        llm.shutdown()
    return Agreement(
        family,
        kind,
        float(difference.max()),
        float(difference.mean()),
        float(run.logits.std()),
        teacher_forced,
        prefix,
        len(run.greedy),
        tokenizer_equal,
        error,
    )
