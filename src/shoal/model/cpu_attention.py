"""The row-wise paged attention kernel for CPUs (csrc/paged_attention_cpu.cpp, the operator
`torch.ops.shoal.paged_attention_rows`).

It is compiled on first use for the effective instruction set (the machine's own, `-march=native`,
unless SHOAL_CPU_ISA caps it, see cpu_features) and cached under
`<shoal cache>/extensions/<hash of source, CPU flags, compiler flags and torch version>`, so a
different CPU, cap or source gets its own build. Where no compiler is available the model uses the
tiled torch kernel instead. Processes building at once take turns on an flock, which the kernel
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
from shoal.model.paged_attention import AttentionMetadata
from shoal.model.weight_cache import default_cache_dir

log = logging.getLogger(__name__)
SOURCE = Path(__file__).parent / "csrc" / "paged_attention_cpu.cpp"
LIBRARY = "shoal_paged_attention_cpu"


def kernel_build() -> tuple[Path, list[str]]:
    """Where this process's kernel is built, and the compiler flags it is built with."""
    features = effective_cpu_features()
    cflags = ["-O3", *features.compiler_flags()]
    key = [
        SOURCE.read_bytes(),
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
        log.warning("rebuilding the CPU attention kernel: %s does not load (%s)", library, exc)
        return False
    return True


@functools.cache
def load_cpu_attention() -> ModuleType | None:
    """The operator namespace holding the compiled kernel, or None if it cannot be built here (cached
    per process: an operator library can be loaded into a process only once anyway)."""
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
                sources=[str(SOURCE)],
                build_directory=str(build_dir),
                extra_cflags=cflags,
                is_python_module=False,
                verbose=False,
            )
    except (RuntimeError, OSError, ImportError) as exc:  # no compiler or headers, read-only cache: tiled kernel
        log.warning("CPU attention kernel unavailable (%s); using the tiled torch kernel", exc)
        return None
    return torch.ops.shoal


def row_paged_attention(
    kernel: ModuleType, q: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Same contract as `tiled_paged_attention`: q [T, H, D] rotated; returns [T, H * D] in q's dtype."""
    k_cache, v_cache = cache
    out = kernel.paged_attention_rows(
        q.float().contiguous(), k_cache, v_cache, meta.block_tables, meta.token_sequences, meta.token_positions, scale
    )
    return out.view(q.shape[0], -1).to(q.dtype)
