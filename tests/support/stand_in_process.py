"""A stand-in for a worker process: Popen's interface, exits when told."""

from __future__ import annotations


class StandInProcess:
    """What the supervisor uses of a Popen: it exits when told to."""

    next_pid = 1000

    def __init__(self):
        StandInProcess.next_pid += 1
        self.pid, self.returncode = StandInProcess.next_pid, None

    def poll(self):
        return self.returncode

    def send_signal(self, sig):
        self.returncode = -sig

    def kill(self):
        self.returncode = -9

    def wait(self, timeout=None):
        return self.returncode
