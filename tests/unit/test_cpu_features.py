"""CPU features from /proc/cpuinfo text, their named levels, and the SHOAL_CPU_ISA cap."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from shoal.model.cpu_features import (
    ISA_LEVELS,
    apply_cpu_isa_cap,
    host_cpuinfo,
    level_of,
    parse_cpuinfo_flags,
    resolve_cpu_features,
)
from tests.support.cpu_flags import HASWELL, ICE_LAKE, SAPPHIRE_RAPIDS, WESTMERE, ZEN4


@pytest.mark.parametrize(
    "cpuinfo,level,native_bf16,onednn_bf16,onednn_fp16",
    [
        (SAPPHIRE_RAPIDS, "amx", True, True, True),
        (ZEN4, "avx512_bf16", True, True, False),
        (ICE_LAKE, "avx512", False, False, False),
        (HASWELL, "avx2", False, False, False),
        (WESTMERE, "baseline", False, False, False),
    ],
)
def test_each_cpu_has_its_level_and_kernels(cpuinfo, level, native_bf16, onednn_bf16, onednn_fp16):
    features = resolve_cpu_features(cpuinfo, None)
    assert (features.level.name, features.host_level.name, features.capped) == (level, level, False)
    assert (features.native_bf16, features.onednn_bf16, features.onednn_fp16) == (native_bf16, onednn_bf16, onednn_fp16)
    assert features.compiler_flags() == ("-march=native",) and features.library_environment() == {}


def test_flags_come_from_the_first_processor_and_nothing_else():
    text = "processor\t: 0\nflags\t\t: sse avx2\nbugs\t\t: avx512f\n\nprocessor\t: 1\nflags\t\t: amx_tile\n"
    assert parse_cpuinfo_flags(text) == {"sse", "avx2"}
    assert parse_cpuinfo_flags("processor : 0\nFeatures : fp asimd\n") == frozenset()
    assert resolve_cpu_features("", None).level.name == "baseline"


def test_a_level_needs_every_level_below_it():
    """AMX flags without AVX-512 (not a real CPU) do not make an amx level."""
    assert level_of(parse_cpuinfo_flags(HASWELL) | {"amx_tile", "amx_bf16", "amx_int8"}).name == "avx2"


def test_sapphire_rapids_capped_to_avx512_bf16_chooses_like_a_zen4():
    capped, zen4 = resolve_cpu_features(SAPPHIRE_RAPIDS, "avx512_bf16"), resolve_cpu_features(ZEN4, "avx512_bf16")
    assert capped.capped and capped.level.name == "avx512_bf16" and capped.host_level.name == "amx"
    for features in (capped, zen4):
        assert (features.native_bf16, features.onednn_bf16, features.onednn_fp16) == (True, True, False)
    assert not capped.flags & {"amx_tile", "amx_bf16", "amx_int8", "avx512_fp16", "avx_vnni"}
    assert {"sse4_2", "aes", "avx512_vbmi2", "avx512_bf16"} <= capped.flags
    assert capped.compiler_flags() == zen4.compiler_flags() == ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni")
    assert capped.library_environment() == {
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
        "ATEN_CPU_CAPABILITY": "avx512",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    }


def test_avx2_cap_removes_all_of_avx512_and_amx():
    features = resolve_cpu_features(SAPPHIRE_RAPIDS, "avx2")
    assert features.level.name == "avx2" and not {f for f in features.flags if f.startswith(("avx512", "amx"))}
    assert {"avx2", "fma", "f16c"} <= features.flags and "avx_vnni" not in features.flags
    assert (features.native_bf16, features.onednn_bf16, features.onednn_fp16) == (False, False, False)
    assert features.compiler_flags() == ("-march=x86-64-v3",)
    assert features.library_environment() == {
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }


def test_capping_at_the_top_level_keeps_every_flag():
    features = resolve_cpu_features(SAPPHIRE_RAPIDS, "amx")
    assert features.flags == parse_cpuinfo_flags(SAPPHIRE_RAPIDS) and features.compiler_flags() == ("-march=native",)
    assert features.library_environment() == {"ATEN_CPU_CAPABILITY": "avx512"}


def test_a_cap_above_the_cpu_or_unknown_is_an_error_naming_both():
    with pytest.raises(ValueError, match=r"SHOAL_CPU_ISA=amx .* its level is avx512_bf16"):
        resolve_cpu_features(ZEN4, "amx")
    with pytest.raises(ValueError, match=r"SHOAL_CPU_ISA=avx512 .* its level is avx2"):
        resolve_cpu_features(HASWELL, "avx512")
    with pytest.raises(ValueError, match=r"'avx3' is not .* baseline, avx2, avx512, avx512_bf16, amx"):
        resolve_cpu_features(ZEN4, "avx3")


def test_applying_the_cap_writes_the_library_variables():
    environ = {"SHOAL_CPU_ISA": "baseline", "PATH": "/bin"}
    features = apply_cpu_isa_cap(environ)
    assert (
        features.capped
        and features.level.name == "baseline"
        and features.host_level == level_of(parse_cpuinfo_flags(host_cpuinfo()))
    )
    assert environ == {
        "SHOAL_CPU_ISA": "baseline",
        "PATH": "/bin",
        "ONEDNN_MAX_CPU_ISA": "SSE41",
        "ATEN_CPU_CAPABILITY": "default",
        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2",
    }
    untouched = {"PATH": "/bin"}
    assert not apply_cpu_isa_cap(untouched).capped and untouched == {"PATH": "/bin"}


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler to ask")
@pytest.mark.parametrize("level", ISA_LEVELS, ids=lambda level: level.name)
def test_the_compiler_takes_every_levels_flags(level, tmp_path):
    source = tmp_path / "probe.cpp"
    source.write_text("int main() { return 0; }\n")
    result = subprocess.run(
        ["c++", "-O3", *level.compiler_flags, "-c", str(source), "-o", str(tmp_path / "probe.o")],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
