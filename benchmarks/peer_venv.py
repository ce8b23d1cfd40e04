"""Virtual environments for the peer engines a benchmark compares shoal with, one per peer.

A peer's pins clash with shoal's, so each lives in its own venv under `benchmarks/.peers/<name>`
(ignored by git), created and filled from PyPI on first use and reused afterwards. A venv whose
install finished holds a marker file with what was installed, so a killed install is redone.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

PEERS_DIR = Path(__file__).resolve().parent / ".peers"
MARKER = "shoal-peer.json"


def peer_python(
    name: str,
    packages: Sequence[str],
    log: Callable[[str], None],
    remove: Sequence[str] = (),
    environment: dict[str, str] | None = None,
) -> Path:
    """The python of venv `name` with `packages` installed (pip, this interpreter's version), less
    `remove`; created on first use. Raises CalledProcessError if the install fails."""
    root = PEERS_DIR / name
    python = root / "bin" / "python"
    wanted = {"packages": list(packages), "remove": list(remove)}
    marker = root / MARKER
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return python
    log(f"  installing {' '.join(packages)} into {root} (first use)")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    subprocess.run([*pip, *packages], check=True, env=environment)
    if remove:
        subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", *remove], check=True)
    marker.write_text(json.dumps(wanted))
    return python


# The peers that are a program, by the name the benchmarks give them: (venv, packages, program).
PEER_PROGRAMS = {
    "vllm-router": ("vllm-router", ["vllm-router"], "vllm-router"),
    "smg": ("sglang-router", ["sglang-router"], "smg"),
    "litellm": ("litellm", ["litellm[proxy]"], "litellm"),
}


def peer_program(name: str, log: Callable[[str], None]) -> Path:
    """The program of peer `name` (PEER_PROGRAMS), from its venv, installed on first use."""
    venv, packages, program = PEER_PROGRAMS[name]
    return peer_python(venv, packages, log).parent / program
