"""What the processes shoal starts on a host share: a free local port, and dying with the parent."""

from __future__ import annotations

import ctypes
import signal
import socket

PR_SET_PDEATHSIG = 1


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def die_with_parent() -> None:
    """For subprocess's preexec_fn (Linux): the child gets SIGKILL when the thread that started it
    ends, so a crashed parent leaves no orphans."""
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
