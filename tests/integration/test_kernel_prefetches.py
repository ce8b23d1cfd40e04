"""The attention kernel asks for the next key tile while it computes this one: its prefetches are in
the built library. GCC deletes a loop of nothing but _mm_prefetch calls, and with them decode
attention waited on memory for every tile (3x its in-cache time)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from shoal.model.native_kernels import LIBRARY, kernel_build, load_native_kernels

FUNCTION = re.compile(r"^[0-9a-f]+ <(.*)>:$")


def instructions_by_function(library: str) -> dict[str, list[str]]:
    """The disassembled library: each function's (demangled) instruction lines."""
    listing = subprocess.run(
        ["objdump", "-d", "-C", "--no-show-raw-insn", library], capture_output=True, text=True, check=True
    ).stdout
    functions: dict[str, list[str]] = {}
    current: list[str] = []
    for line in listing.splitlines():
        match = FUNCTION.match(line)
        if match:
            current = functions.setdefault(match.group(1), [])
        elif line.startswith(" "):
            current.append(line)
    return functions


@pytest.mark.skipif(shutil.which("objdump") is None, reason="objdump (binutils) is not installed")
def test_the_attention_kernel_prefetches_the_cache_rows_it_reads_next():
    if load_native_kernels() is None:
        pytest.skip("the native kernels do not build here")
    functions = instructions_by_function(str(kernel_build()[0] / f"{LIBRARY}.so"))
    attention = {name: lines for name, lines in functions.items() if "attend<" in name and "BFloat16" in name}
    assert attention, "no bfloat16 attention function in the library"
    prefetching = [name for name, lines in attention.items() if any("prefetcht1" in line for line in lines)]
    assert prefetching, "the bfloat16 attention kernel issues no prefetch"
