"""Memory sizes and KV-cache budgets as people write them, parsed in this one place.

A size always has a unit ("512MiB", "2GB", "1.5TiB"; "B" for bytes); a bare number is a fraction
of free memory in (0, 1]. So `kv_cache: 1.0` is all free memory, never one byte, and a number that
is neither a fraction nor a size is refused with the reason. Imports nothing heavy: the router and
the deployment config use it too.
"""

from __future__ import annotations

import re

UNITS = {
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]+)\s*")
_NUMBER = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*")


def parse_size(text: str) -> int:
    """Bytes in a size such as "512MiB" or "2GB"; ValueError naming the text otherwise."""
    match = _SIZE.fullmatch(text)
    if not match or match.group(2).upper() not in UNITS:
        raise ValueError(f"{text!r} is not a size such as 512MiB or 2GB")
    return int(float(match.group(1)) * UNITS[match.group(2).upper()])


def parse_kv_cache(value: str | float | int) -> dict[str, int | float]:
    """A KV-cache budget as the EngineConfig fields it sets: {"kv_cache_fraction": f} for a number
    (or numeric text) in (0, 1], {"kv_cache_bytes": n} for a size. ValueError with the reason."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is neither a fraction of free memory like 0.3 nor a size like 512MiB")
    if isinstance(value, str) and not _NUMBER.fullmatch(value):
        num_bytes = parse_size(value)
        if num_bytes < 1:
            raise ValueError(f"{value!r} is an empty KV-cache budget")
        return {"kv_cache_bytes": num_bytes}
    try:
        fraction = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{value!r} is neither a fraction of free memory like 0.3 nor a size like 512MiB") from None
    if not 0 < fraction <= 1:
        raise ValueError(f"{value!r}: a fraction of free memory must be in (0, 1]; a size needs a unit, such as 512MiB")
    return {"kv_cache_fraction": fraction}
