"""The CPU attention kernel's build survives a builder killed mid-build: the lock it left behind
does not stall the next process, which builds (or finds) the kernel and loads it."""

from __future__ import annotations

import os
import subprocess
import sys

LOAD_AFTER_A_DEAD_BUILDER = """
from shoal.model.native_kernels import kernel_build, load_native_kernels
build_dir, _ = kernel_build()
build_dir.mkdir(parents=True, exist_ok=True)
(build_dir / "lock").write_text("")  # what a builder killed -9 inside torch's build leaves
assert load_native_kernels() is not None, "the kernel did not load"
print("loaded")
"""


def test_a_lock_left_by_a_killed_builder_does_not_stall_the_next(shoal_cache_dir):
    result = subprocess.run(
        [sys.executable, "-c", LOAD_AFTER_A_DEAD_BUILDER],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "SHOAL_CACHE_DIR": str(shoal_cache_dir)},
    )
    assert result.returncode == 0 and result.stdout.strip() == "loaded", result.stderr[-2000:]
