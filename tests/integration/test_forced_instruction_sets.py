"""The engine under SHOAL_CPU_ISA on any machine at or above the level: an AVX2-only CPU and a Zen 4
(AVX512-BF16, no AMX, no avx512_fp16). Each level runs in its own process, where the cap reaches torch's
libraries before their first use: ATen and oneDNN report the narrower instruction set, the
C++ kernels are compiled for it, every dtype runs, runs stay batch invariant (a mixture of experts
with gpt-oss's clamped gate too), and the native matrix multiply's rows are the same bits at every
row count."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from shoal.model.cpu_features import LEVEL_NAMES, effective_cpu_features
from tests.support.engine_under_isa_cap import REPORT_PREFIX
from tests.support.family_variants import COMMON
from tests.support.kernel_builds import FORCED_LEVELS
from tests.support.linear_rows_check import TOLERANCE, bf16_pairs_digest
from tests.support.lora_adapters import write_adapter
from tests.support.tiny_model import write_random_family_model

REPO = Path(__file__).resolve().parents[2]
DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Expected:
    aten: str
    onednn_bf16: bool
    backends: dict[str, tuple[str, str]]  # dtype: (packed weights' backend, shared weights')
    auto_dtype: str
    compiler_flags: str
    onednn_isa: str


LEVELS = {
    "avx2": Expected(
        "AVX2",
        False,
        {
            "float32": ("native f32", "onednn float32"),
            "bfloat16": ("native bf16", "aten bfloat16"),
            "float16": ("native f16", "aten float16"),
        },
        "torch.float32",
        "-march=x86-64-v3",
        "isa:Intel AVX2",
    ),
    "avx512_bf16": Expected(
        "AVX512",
        True,
        {
            "float32": ("native f32", "onednn float32"),
            "bfloat16": ("native bf16", "onednn bfloat16"),
            "float16": ("native f16", "aten float16"),
        },
        "torch.bfloat16",
        "-march=x86-64-v4 -mavx512bf16 -mavx512vnni",
        "isa:Intel AVX-512 with Intel DL Boost and bfloat16 support",
    ),
}


def run_engine_under_cap(
    level: str, model_dir: Path, moe_dir: Path, lora_dir: Path, cache_dir: Path
) -> tuple[dict, list[str]]:
    env = {**os.environ, "SHOAL_CPU_ISA": level, "ONEDNN_VERBOSE": "1"}
    argv = [str(model_dir), str(moe_dir), str(lora_dir), str(cache_dir), *DTYPES]
    result = subprocess.run(
        [sys.executable, "-m", "tests.support.engine_under_isa_cap", *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = result.stdout.splitlines()
    return json.loads(lines[-1].removeprefix(REPORT_PREFIX)), lines


@pytest.fixture(scope="module")
def report_at(tiny_model_dir, shoal_cache_dir, tmp_path_factory):
    """report_at(level): the engine's report and output lines under that level, run once a module."""
    reports = {}
    moe_dir = tmp_path_factory.mktemp("gpt-oss")
    fields = dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=5, swiglu_limit=1.0)
    write_random_family_model(moe_dir, "GptOssConfig", "GptOssForCausalLM", {**COMMON, "head_dim": 16, **fields})
    lora_dir = tmp_path_factory.mktemp("lora") / "a"
    write_adapter(tiny_model_dir, lora_dir)

    def report(level: str) -> tuple[dict, list[str]]:
        if level not in reports:
            reports[level] = run_engine_under_cap(level, tiny_model_dir, moe_dir, lora_dir, shoal_cache_dir)
        return reports[level]

    return report


@pytest.mark.parametrize("level", FORCED_LEVELS)
def test_engine_runs_every_dtype_invariantly_at_a_forced_level(level, report_at):
    host = effective_cpu_features().host_level.name
    if LEVEL_NAMES.index(host) < LEVEL_NAMES.index(level):
        pytest.skip(f"this CPU's level is {host}, below {level}")
    expected = LEVELS[level]
    report, lines = report_at(level)

    assert (report["level"], report["capped"], report["auto_dtype"]) == (level, True, expected.auto_dtype)
    # torch's own view: ATen's kernels, and oneDNN's 16-bit support, which follows its capped ISA.
    assert report["torch"] == {"aten": expected.aten, "onednn_bf16": expected.onednn_bf16, "onednn_fp16": False}
    assert (report["features"]["onednn_bf16"], report["features"]["onednn_fp16"]) == (expected.onednn_bf16, False)
    onednn_isa = [
        line.removeprefix("onednn_verbose,v1,info,cpu,")
        for line in lines
        if line.startswith("onednn_verbose,v1,info,cpu,isa:")
    ]
    implementations = {line.split(",")[6] for line in lines if line.startswith("onednn_verbose,v1,primitive,exec")}
    assert onednn_isa == [expected.onednn_isa]
    assert implementations and not [
        name for name in implementations if "amx" in name or "fp16" in name or (level == "avx2" and "avx512" in name)
    ], implementations

    if shutil.which("c++"):
        assert report["kernel_cflags"].endswith(expected.compiler_flags), report["kernel_cflags"]
    for dtype, run in report["runs"].items():
        assert (run["backend"], run["shared_backend"]) == expected.backends[dtype], dtype
        assert dtype != "float32" or run["shared_distinct_outputs"] > 1, (dtype, run)
    if shutil.which("c++"):  # the narrower native paths (AVX2, AVX512-BF16 dot products): same bits at every M
        formats = report["linear_rows"]
        assert {name: r["differing"] for name, r in formats.items()} == {name: [] for name in TOLERANCE}
        assert all(r["relative_error"] < TOLERANCE[name] for name, r in formats.items()), formats
        assert run["attention_uses_tiles"] == (shutil.which("c++") is None), dtype
        assert run["invariant"] and run["distinct_outputs"] > 1, (dtype, run)
        assert run["speculation_keeps_tokens"] and run["drafts_kept"] > 0, (dtype, run)
        assert run["lora_invariant"] and run["lora_changes_tokens"] and run["lora_keeps_the_base"], (dtype, run)
    if shutil.which("c++"):
        moe = report["moe"]
        assert moe["native_experts"] and moe["invariant"] and moe["distinct_outputs"] > 1, moe


def test_quantized_blocks_against_bf16_x_are_the_same_bits_with_and_without_bf16_dot_products(report_at):
    """A stream may move between a CPU with AVX512-BF16 and one without: the dot products and their
    emulation with FMAs (the AVX2 build) give the same bits."""
    if not shutil.which("c++"):
        pytest.skip("no C++ compiler: no native kernels to compare")
    if not effective_cpu_features().native_bf16:
        pytest.skip("this CPU has no bf16 dot products: both sides would be the emulation")
    report, _ = report_at("avx2")
    assert report["bf16_pairs_digest"] == bf16_pairs_digest()
