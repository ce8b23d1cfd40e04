"""What this CPU can run, and the cap that narrows it: `SHOAL_CPU_ISA=baseline|avx2|avx512|avx512_bf16|amx`.

Every CPU-dependent choice (the "auto" dtype, the GEMM backend of each dtype, the flags the attention
kernel is compiled with) reads `effective_cpu_features()`: the flags of /proc/cpuinfo, read once per
process, less every flag that a level above the cap brings. The levels, each including those below:

    baseline     any x86-64
    avx2         x86-64-v3 (Haswell, Zen 1-3)
    avx512       AVX-512 F/BW/CD/DQ/VL (Skylake-SP, Ice Lake)
    avx512_bf16  AVX512-BF16 and VNNI (Cooper Lake, Zen 4 and 5)
    amx          AMX tiles, with avx512_fp16 and avx_ne_convert where present (Sapphire Rapids and later)

Torch's libraries are capped through the environment, which they read when they are first used and
which child processes inherit: oneDNN (ONEDNN_MAX_CPU_ISA), ATen (ATEN_CPU_CAPABILITY) and MKL
(MKL_ENABLE_INSTRUCTIONS). So `apply_cpu_isa_cap()` must run before torch runs its first operation.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import MutableMapping
from dataclasses import dataclass

from shoal.config.environment import CPU_ISA_VARIABLE

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class IsaLevel:
    """One instruction-set level. A CPU is at this level when it has every `required` flag of it and
    of the levels below; a cap below it removes its `required` and `optional` flags. The other fields
    say how torch's libraries and the C++ compiler are held to this level (None: not capped)."""

    name: str
    required: frozenset[str]
    optional: frozenset[str]
    onednn_isa: str | None
    aten_capability: str
    mkl_instructions: str | None
    compiler_flags: tuple[str, ...]


ISA_LEVELS = (
    IsaLevel("baseline", frozenset(), frozenset(), "SSE41", "default", "SSE4_2", ("-march=x86-64",)),
    IsaLevel(
        "avx2",
        frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"}),
        frozenset(),
        "AVX2",
        "avx2",
        "AVX2",
        ("-march=x86-64-v3",),
    ),
    IsaLevel(
        "avx512",
        frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}),
        frozenset(
            {"avx512ifma", "avx512vbmi", "avx512_vbmi2", "avx512_bitalg", "avx512_vpopcntdq", "avx512_vp2intersect"}
        ),
        "AVX512_CORE",
        "avx512",
        "AVX512",
        ("-march=x86-64-v4",),
    ),
    IsaLevel(
        "avx512_bf16",
        frozenset({"avx512_bf16", "avx512_vnni"}),
        frozenset(),
        "AVX512_CORE_BF16",
        "avx512",
        "AVX512",
        ("-march=x86-64-v4", "-mavx512bf16", "-mavx512vnni"),
    ),
    IsaLevel(
        "amx",
        frozenset({"amx_tile", "amx_bf16", "amx_int8"}),
        frozenset(
            {"avx512_fp16", "avx_ne_convert", "avx_vnni", "avx_vnni_int8", "avx_ifma", "amx_fp16", "amx_complex"}
        ),
        None,
        "avx512",
        None,
        ("-march=native",),
    ),
)
LEVEL_NAMES = tuple(level.name for level in ISA_LEVELS)


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU as shoal may use it: `flags` are the host's /proc/cpuinfo flags less those above `level`
    when `capped`. Invariant: `level` is the highest level whose required flags are all in `flags`."""

    flags: frozenset[str]
    level: IsaLevel
    host_level: IsaLevel
    capped: bool

    def has(self, *flags: str) -> bool:
        return all(flag in self.flags for flag in flags)

    @property
    def native_bf16(self) -> bool:
        """bfloat16 dot products in hardware (AVX512-BF16 or AMX)."""
        return self.has("avx512_bf16") or self.has("amx_bf16")

    @property
    def onednn_bf16(self) -> bool:
        """oneDNN's bfloat16 GEMMs run here in hardware (bfloat16 dot products, or avx_ne_convert). On
        plain AVX-512 torch would allow them too, but oneDNN emulates them there, several times slower
        than float32 (docs/performance.md, "Instruction sets")."""
        return self.native_bf16 or self.has("avx_ne_convert")

    @property
    def onednn_fp16(self) -> bool:
        """oneDNN's float16 GEMMs run here (the check torch makes before prepacking float16 weights)."""
        return self.has("avx512_fp16") or self.has("avx_ne_convert")

    def compiler_flags(self) -> tuple[str, ...]:
        """gcc flags for native code that must run on these features: the host's own when not capped."""
        return self.level.compiler_flags if self.capped else ("-march=native",)

    def library_environment(self) -> dict[str, str]:
        """The variables that hold oneDNN, ATen and MKL to the cap (none when not capped)."""
        if not self.capped:
            return {}
        values = {
            "ONEDNN_MAX_CPU_ISA": self.level.onednn_isa,
            "ATEN_CPU_CAPABILITY": self.level.aten_capability,
            "MKL_ENABLE_INSTRUCTIONS": self.level.mkl_instructions,
        }
        return {name: value for name, value in values.items() if value is not None}

    def describe(self) -> str:
        if not self.capped:
            return f"{self.level.name} (this CPU's level)"
        return f"{self.level.name} (capped by {CPU_ISA_VARIABLE}; this CPU: {self.host_level.name})"


def parse_cpuinfo_flags(cpuinfo: str) -> frozenset[str]:
    """The flags of the first processor in /proc/cpuinfo text (none on CPUs that list no x86 flags)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def level_of(flags: frozenset[str]) -> IsaLevel:
    """The highest level whose required flags, and those of every level below, are all in `flags`."""
    reached = ISA_LEVELS[0]
    for level in ISA_LEVELS[1:]:
        if not level.required <= flags:
            break
        reached = level
    return reached


def resolve_cpu_features(cpuinfo: str, cap: str | None) -> CpuFeatures:
    """The host of `cpuinfo` narrowed to level `cap` (None or "": not capped).

    Raises ValueError for an unknown level or one above the host's, naming both."""
    flags = parse_cpuinfo_flags(cpuinfo)
    host = level_of(flags)
    if not cap:
        return CpuFeatures(flags, host, host, capped=False)
    if cap not in LEVEL_NAMES:
        raise ValueError(
            f"{CPU_ISA_VARIABLE}={cap!r} is not an instruction-set level; use one of {', '.join(LEVEL_NAMES)}"
        )
    position = LEVEL_NAMES.index(cap)
    if position > LEVEL_NAMES.index(host.name):
        raise ValueError(f"{CPU_ISA_VARIABLE}={cap} asks for more than this CPU has: its level is {host.name}")
    removed = frozenset().union(*(level.required | level.optional for level in ISA_LEVELS[position + 1 :]))
    return CpuFeatures(flags - removed, ISA_LEVELS[position], host, capped=True)


@functools.cache
def host_cpuinfo() -> str:
    """/proc/cpuinfo, read once per process ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            return f.read()
    except OSError:
        return ""


def apply_cpu_isa_cap(environ: MutableMapping[str, str] = os.environ) -> CpuFeatures:
    """Validates `SHOAL_CPU_ISA` in `environ` and writes the library variables that hold torch to it.

    Program entries call it before torch runs its first operation (torch reads those variables once,
    at first use); child processes inherit them. Raises ValueError for a cap this CPU cannot honour."""
    features = resolve_cpu_features(host_cpuinfo(), environ.get(CPU_ISA_VARIABLE))
    environ.update(features.library_environment())
    return features


@functools.cache
def effective_cpu_features() -> CpuFeatures:
    """This process's CPU features under its cap; the first call applies the cap and logs the level,
    warning when the cap came too late for ATen (torch had already run an operation)."""
    import torch

    features = apply_cpu_isa_cap()
    aten = torch.backends.cpu.get_cpu_capability()
    log.info("CPU instruction set: %s; ATen kernels: %s", features.describe(), aten)
    if features.capped and aten.lower() != features.level.aten_capability:
        log.warning(
            "%s=%s came after torch started: ATen keeps its %s kernels, and oneDNN may keep its own; "
            "set it before the process starts",
            CPU_ISA_VARIABLE,
            features.level.name,
            aten,
        )
    return features
