"""The attention kernel compiled ahead, in the background, for every instruction-set level the suite
runs engines at: this process's own and each forced level this CPU can run.

A build runs two compilers at once (the library's two translation units) for about 40 s on this
2-core machine; the unit tests run beside them. Builds run one after another, each in a process of
its own (a level is fixed before torch loads). A test that needs a kernel still being built waits
for it on the build's lock, as any second process does, so no build is ever done twice.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading

from shoal.config.environment import CPU_ISA_VARIABLE
from shoal.model.cpu_features import LEVEL_NAMES, effective_cpu_features

FORCED_LEVELS = ("avx2", "avx512_bf16")  # the narrower CPUs the suite forces: AVX2-only, and Zen 4

BUILD = (
    "from shoal.model.cpu_features import apply_cpu_isa_cap; apply_cpu_isa_cap(); "
    "from shoal.model.native_kernels import load_native_kernels; load_native_kernels()"
)


def forced_levels_here() -> list[str]:
    """The forced levels at or below this CPU's."""
    host = LEVEL_NAMES.index(effective_cpu_features().host_level.name)
    return [level for level in FORCED_LEVELS if LEVEL_NAMES.index(level) <= host]


class KernelBuilds:
    """Builds into `cache_dir` (SHOAL_CACHE_DIR of the processes the tests start) until done or stopped."""

    def __init__(self, cache_dir):
        self.environment = {**os.environ, "SHOAL_CACHE_DIR": str(cache_dir)}
        self.levels = [None, *forced_levels_here()]  # None: this process's own level
        self.current: subprocess.Popen | None = None
        self.stopped = False
        self.lock = threading.Lock()  # held while a build is started or stopped
        self.thread = threading.Thread(target=self._build_all, name="kernel-builds", daemon=True)
        self.thread.start()

    def _build_all(self) -> None:
        for level in self.levels:
            environment = dict(self.environment)
            if level is not None:
                environment[CPU_ISA_VARIABLE] = level
            with self.lock:
                if self.stopped:
                    return
                self.current = subprocess.Popen(
                    [sys.executable, "-c", BUILD], env=environment, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
            self.current.wait()

    def stop(self) -> None:
        """Ends the build under way, if any (its lock dies with it), and starts no other."""
        with self.lock:
            self.stopped = True
            if self.current is not None and self.current.poll() is None:
                self.current.kill()
        self.thread.join()
