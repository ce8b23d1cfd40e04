"""Token-count distributions for prompts and outputs, written on the command line as `N` (fixed),
`LO:HI` (uniform) or `MEAN~STD` (normal)."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Fixed:
    """Always `value` tokens (≥ 1)."""

    value: int

    def __post_init__(self) -> None:
        if self.value < 1:
            raise ValueError(f"a token count must be at least 1, not {self.value}")

    def sample(self, rng: random.Random) -> int:
        return self.value

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class Uniform:
    """An integer drawn uniformly from [low, high], both included; 1 ≤ low ≤ high."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"a uniform range needs 1 <= LO <= HI, not {self.low}:{self.high}")

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return f"{self.low}:{self.high}"


@dataclass(frozen=True)
class Normal:
    """round(N(mean, std)) clipped to [1, 2·mean - 1]: positive, and (the clipping being symmetric)
    still centred on `mean`. mean ≥ 1, std ≥ 0."""

    mean: float
    std: float

    def __post_init__(self) -> None:
        if self.mean < 1 or self.std < 0:
            raise ValueError(f"a normal length needs MEAN >= 1 and STD >= 0, not {self.mean}~{self.std}")

    def sample(self, rng: random.Random) -> int:
        return min(max(round(rng.gauss(self.mean, self.std)), 1), max(round(2 * self.mean) - 1, 1))

    def __str__(self) -> str:
        return f"{self.mean:g}~{self.std:g}"


LengthDistribution = Fixed | Uniform | Normal


def parse_length(text: str) -> LengthDistribution:
    """`128` → Fixed, `64:256` → Uniform, `128~32` → Normal; ValueError names what is wrong."""
    text = text.strip()
    number = r"\s*([0-9]*\.?[0-9]+)\s*"
    if re.fullmatch(r"[0-9]+", text):
        return Fixed(int(text))
    if match := re.fullmatch(r"([0-9]+)\s*:\s*([0-9]+)", text):
        return Uniform(int(match.group(1)), int(match.group(2)))
    if match := re.fullmatch(number + "~" + number, text):
        return Normal(float(match.group(1)), float(match.group(2)))
    raise ValueError(f"{text!r} is not a length: N (fixed), LO:HI (uniform) or MEAN~STD (normal)")
