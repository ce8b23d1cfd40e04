"""The keep-alive a worker sends on a silent stream: an SSE comment carrying what the router needs
to tell a busy worker from a hung one.

On the wire: `: keep-alive {"busy_s": 1.2, "step_s": 3.4}` and a blank line. `busy_s` is how long
the worker's engine has been on its current step (or command), `step_s` how long that step is
expected to take (absent outside a step or before the engine knows its speed). A bare
`: keep-alive` (what the router sends its own clients) carries no figures.

Comments are valid SSE, but some clients mishandle them (vLLM's benchmark client strips each read
and then loses the event boundaries after a comment). So a worker sends keep-alives only on a
request carrying REQUEST_HEADER (routers do), and a router sends its client a bare one only after
CLIENT_INTERVAL_S of silence, which is what keeps idle proxies from cutting a held stream.
"""

from __future__ import annotations

import msgspec

PREFIX = b": keep-alive"
REQUEST_HEADER = "x-shoal-keep-alive"
CLIENT_INTERVAL_S = 15.0


class KeepAlive(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Invariant: figures, when present, are finite and non-negative (parse enforces it)."""

    busy_s: float | None = None
    step_s: float | None = None

    def encode(self) -> bytes:
        """The whole SSE comment, blank line included."""
        return PREFIX + b" " + msgspec.json.encode(self) + b"\n\n"


BARE = PREFIX + b"\n\n"


def parse_keep_alive(line: bytes) -> KeepAlive | None:
    """The keep-alive one SSE line carries; None when the line is not a keep-alive. A keep-alive
    whose figures are malformed is kept as a bare one: it still proves the worker is talking."""
    line = line.rstrip(b"\r\n")
    if line != PREFIX and not line.startswith(PREFIX + b" "):
        return None
    body = line[len(PREFIX) :].strip()
    if not body:
        return KeepAlive()
    try:
        keep_alive = msgspec.json.decode(body, type=KeepAlive)
    except msgspec.DecodeError:
        return KeepAlive()
    figures = (keep_alive.busy_s, keep_alive.step_s)
    if any(f is not None and not 0 <= f < float("inf") for f in figures):
        return KeepAlive()
    return keep_alive
