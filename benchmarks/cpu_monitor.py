"""How busy the CPU was with other processes while a section ran. Standard library only: peer
benchmarks that run in their own virtual environments (llama_cpp_runs.py) use it too."""

from __future__ import annotations

import os
import resource
import time
from typing import Any


class CpuMonitor:
    """How many cores other processes kept busy while a section ran (from /proc/stat minus our own
    CPU time and our live child processes', such as tensor-parallel ranks). Tells a clean
    measurement from one that shared the CPU with someone else."""

    def __init__(self) -> None:
        self.tick = os.sysconf("SC_CLK_TCK")

    def _sample(self) -> tuple[float, float, float]:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
            busy = (sum(fields[:8]) - fields[3] - fields[4]) / self.tick  # minus idle and iowait
        except OSError:
            busy = float("nan")
        ru = resource.getrusage(resource.RUSAGE_SELF)
        return time.perf_counter(), busy, ru.ru_utime + ru.ru_stime + self._children_cpu()

    def _children_cpu(self) -> float:
        """CPU seconds the live child processes of this one have used (utime + stime, /proc)."""
        me, total = str(os.getpid()), 0.0
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()  # after the command name
            except OSError:
                continue
            if fields[1] == me:  # ppid
                total += (int(fields[11]) + int(fields[12])) / self.tick
        return total

    def __enter__(self) -> CpuMonitor:
        self.start = self._sample()
        return self

    def __exit__(self, *exc: Any) -> None:
        end = self._sample()
        wall = end[0] - self.start[0]
        self.wall_s = wall
        self.own_cores = (end[2] - self.start[2]) / wall if wall > 0 else float("nan")
        self.other_cores = max(0.0, ((end[1] - self.start[1]) - (end[2] - self.start[2])) / wall) if wall > 0 else 0.0


def wait_for_idle(max_wait_s: float, threshold_cores: float = 0.15, window_s: float = 2.0) -> float:
    """Waits (up to max_wait_s) until other processes use less than threshold_cores; returns the last load."""
    deadline = time.time() + max_wait_s
    other = float("nan")
    while True:
        with CpuMonitor() as mon:
            time.sleep(window_s)
        other = mon.other_cores
        if other < threshold_cores or time.time() >= deadline:
            return other
        print(f"  waiting for an idle CPU: other processes use {other:.2f} cores", flush=True)
        time.sleep(3.0)
