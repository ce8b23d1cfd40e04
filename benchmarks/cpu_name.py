"""The CPU a figure was measured on, as lscpu names it: model name, family and model numbers, and
the instruction-set features that choose shoal's kernels. Standard library only."""

from __future__ import annotations

import subprocess

KERNEL_FEATURES = ("avx512f", "avx512_bf16", "avx512_vnni", "avx512_fp16", "amx_bf16")


def lscpu_fields() -> dict[str, str]:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return {}
    fields = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_description() -> str:
    """For example "AMD EPYC (lscpu family 26 model 2; 2 CPUs; avx512f avx512_bf16 avx512_vnni)"."""
    fields = lscpu_fields()
    flags = set(fields.get("Flags", "").split())
    features = " ".join(f for f in KERNEL_FEATURES if f in flags) or "no AVX-512"
    return (
        f"{fields.get('Model name', '?')} (lscpu family {fields.get('CPU family', '?')} model "
        f"{fields.get('Model', '?')}; {fields.get('CPU(s)', '?')} CPUs; {features})"
    )
