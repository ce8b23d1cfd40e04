"""shoal's C++ CPU kernels (csrc/), one library: the batch-invariant matrix multiply
(`torch.classes.shoal.PackedLinear`), the row-wise paged attention (`torch.ops.shoal.paged_attention_rows`),
the fused decoder layer (`torch.classes.shoal.DecoderLayer`), its RMSNorm (`torch.ops.shoal.rms_norm_rows`),
the greedy choice over logits (`torch.ops.shoal.argmax_rows`) and the random one
(`torch.ops.shoal.sample_rows`).

They need AVX2, FMA and F16C (x86-64-v3). They are compiled on first use for the effective
instruction set (the machine's own, `-march=native`, unless SHOAL_CPU_ISA caps it, see cpu_features)
and cached under `<shoal cache>/extensions/<hash of sources, CPU flags, compiler flags and torch
version>`, so a different CPU, cap or source gets its own build. Below AVX2, or where no compiler
is available, the model uses torch kernels instead. Processes building at once take turns on an flock, which the kernel
releases when its holder dies: a worker killed mid-build leaves no lock that stalls the next one.
A build directory that already holds the library is loaded without calling the build system (its
name says what it was built from), which keeps a worker's start short.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
from pathlib import Path
from types import ModuleType

import torch

from shoal.model.cpu_features import effective_cpu_features
from shoal.model.weight_cache import default_cache_dir

log = logging.getLogger(__name__)
CSRC = Path(__file__).parent / "csrc"
# The library is two translation units, which the build compiles at once (about 40 s each on one core
# of a 2-core Xeon, against 70 s for one unit of everything): paged attention, and a unit including
# every other kernel file. SOURCES: every kernel file.
UNITY_SOURCE = CSRC / "shoal_cpu_kernels.cpp"
TRANSLATION_UNITS = (UNITY_SOURCE, CSRC / "paged_attention_cpu.cpp")
SOURCES = (
    *(CSRC / line.split('"')[1] for line in UNITY_SOURCE.read_text().splitlines() if line.startswith("#include")),
    *TRANSLATION_UNITS[1:],
)
HEADERS = tuple(CSRC / name for name in ("vec.h", "panel_layout.h", "linear_cpu.h", "paged_attention_cpu.h"))
LIBRARY = "shoal_cpu_kernels"
# No implicit fused multiply-adds: the kernels' rounding is exactly what their source says. OpenMP:
# ATen's parallel_for runs its loop on torch's thread team only in code compiled with it.
_FIXED_CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")


def kernel_build() -> tuple[Path, list[str]]:
    """Where this process's kernels are built, and the compiler flags they are built with."""
    features = effective_cpu_features()
    cflags = [*_FIXED_CFLAGS, *features.compiler_flags()]
    key = [
        *(source.read_bytes() for source in (UNITY_SOURCE, *SOURCES, *HEADERS)),
        " ".join(sorted(features.flags)).encode(),
        " ".join(cflags).encode(),
        torch.__version__.encode(),
    ]
    return default_cache_dir() / "extensions" / hashlib.sha256(b"\0".join(key)).hexdigest()[:16], cflags


def _load_built(library: Path) -> bool:
    """Loads a library a finished build left; False if there is none or it does not load (a build
    killed while linking), for the build system to make it again."""
    if not library.exists():
        return False
    try:
        torch.ops.load_library(str(library))
    except OSError as exc:
        log.warning("rebuilding the CPU kernels: %s does not load (%s)", library, exc)
        return False
    return True


@functools.cache
def load_native_kernels() -> ModuleType | None:
    """The operator namespace holding the compiled kernels, or None if they cannot be built here
    (cached per process: an operator library can be loaded into a process only once anyway)."""
    features = effective_cpu_features()
    if not features.has("avx2", "fma", "f16c"):
        log.info("CPU level %s is below AVX2: no native kernels, torch kernels run", features.describe())
        return None
    build_dir, cflags = kernel_build()
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
        with open(build_dir / "shoal.lock", "w") as turn:
            fcntl.flock(turn, fcntl.LOCK_EX)
            if _load_built(build_dir / f"{LIBRARY}.so"):
                return torch.ops.shoal

            from torch.utils import cpp_extension

            # Holding the turn, any lock of torch's own here was left by a builder that died.
            (build_dir / "lock").unlink(missing_ok=True)
            cpp_extension.load(
                name=LIBRARY,
                sources=[str(unit) for unit in TRANSLATION_UNITS],
                build_directory=str(build_dir),
                extra_cflags=cflags,
                extra_ldflags=["-fopenmp"],
                is_python_module=False,
                verbose=False,
            )
    except (RuntimeError, OSError, ImportError) as exc:  # no compiler or headers, read-only cache
        log.warning("CPU kernels unavailable (%s); using torch kernels", exc)
        return None
    return torch.ops.shoal
