"""Which workers the simulated fleet has: classes of workers in given fractions.

On the command line a fleet is `--workers N --mix "CLASS;CLASS..."`, each class written
`NAME:FRACTION[:KEY=VALUE,...]`, e.g. `fast:0.2:speed=4,kv=200000;slow:0.8:speed=1,kv=50000`.
A YAML file says the same (`workers: N` and `classes:`, a list of mappings with `name`,
`fraction` and the same keys). Keys, all optional:

- `speed`: how many times faster than the calibrated worker its steps are (default 1);
- `kv`: KV-cache tokens; `seqs`: max_num_seqs; `max_len`: max_model_len (default: the calibration
  source's figures, else 65536, 64 and 8192); `batch_tokens`: max_num_batched_tokens (512);
- `tier_host`, `tier_disk`: KV-tier tokens below the paged cache, in host memory and on disk
  (default none); `tier_host_rate`, `tier_disk_rate`: tokens a second copied back from each
  (shoal.simulate.kv_tier);
- `mtbf`: mean seconds between failures (exponential; default: never fails); `repair`: seconds
  until a failed worker serves again, with an empty cache (default 30);
- `threads`, `per_host`, `cores`: each worker computes with `threads` threads, `per_host` workers
  share a host with `cores` cores (default: a host of their own); while more threads step than the
  host has cores, every step there takes proportionally longer.

Fractions are weights (normalized); counts are rounded by largest remainder, so they add up to N.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from shoal.simulate.calibration import WorkerFigures
from shoal.simulate.cost_model import CalibrationFigures, StepCost
from shoal.simulate.kv_tier import DEFAULT_DISK_TOKENS_PER_S, DEFAULT_HOST_TOKENS_PER_S

DEFAULT_KV_TOKENS = 65536
DEFAULT_MAX_NUM_SEQS = 64
DEFAULT_MAX_MODEL_LEN = 8192
INTEGER_KEYS = ("kv", "seqs", "max_len", "batch_tokens", "threads", "per_host", "tier_host", "tier_disk")


@dataclass(frozen=True)
class WorkerClass:
    """One kind of worker and its share of the fleet (see the module docstring for the keys).
    Invariant: fraction, speed, repair and mtbf (when set) > 0; counts ≥ 1."""

    name: str
    fraction: float
    speed: float = 1.0
    kv: int | None = None
    seqs: int | None = None
    max_len: int | None = None
    batch_tokens: int = 512
    mtbf: float | None = None
    repair: float = 30.0
    threads: int = 1
    per_host: int = 1
    cores: float | None = None
    tier_host: int = 0
    tier_disk: int = 0
    tier_host_rate: float = DEFAULT_HOST_TOKENS_PER_S
    tier_disk_rate: float = DEFAULT_DISK_TOKENS_PER_S

    def __post_init__(self) -> None:
        if not self.name or any(c in self.name for c in ":;,="):
            raise ValueError(f"a worker class needs a name without ':;,=', not {self.name!r}")
        if self.fraction <= 0 or self.speed <= 0 or self.repair <= 0:
            raise ValueError(f"{self.name}: fraction, speed and repair must be above 0")
        if self.mtbf is not None and self.mtbf <= 0:
            raise ValueError(f"{self.name}: mtbf must be above 0")
        if self.cores is not None and self.cores <= 0:
            raise ValueError(f"{self.name}: cores must be above 0")
        if self.tier_host < 0 or self.tier_disk < 0 or self.tier_host_rate <= 0 or self.tier_disk_rate <= 0:
            raise ValueError(f"{self.name}: tier sizes must not be negative, tier rates must be above 0")
        for key in ("kv", "seqs", "max_len", "batch_tokens", "threads", "per_host"):
            value = getattr(self, key)
            if value is not None and value < 1:
                raise ValueError(f"{self.name}: {key} must be at least 1")

    @classmethod
    def from_mapping(cls, raw: dict) -> WorkerClass:
        """From YAML or the parsed `--mix`; unknown keys and wrong types are errors."""
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(raw) - set(fields))
        if unknown:
            raise ValueError(f"unknown worker class keys {unknown}; known: {sorted(fields)}")
        values = {}
        for key, value in raw.items():
            kind = int if key in INTEGER_KEYS else float
            try:
                values[key] = value if key == "name" or value is None else kind(value)
            except (TypeError, ValueError):
                raise ValueError(f"{raw.get('name')}: {key}={value!r} is not a number") from None
        missing = [key for key in ("name", "fraction") if key not in values]
        if missing:
            raise ValueError(f"a worker class needs {' and '.join(missing)}")
        return cls(**values)


@dataclass(frozen=True)
class WorkerSpec:
    """One simulated worker, resolved: its step cost and calibration already scaled by its speed."""

    worker_id: str
    worker_class: str
    cost: StepCost
    calibration: CalibrationFigures
    kv_tokens: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    mtbf_s: float | None
    repair_s: float
    host: str
    threads: int
    host_cores: float
    tier_host_tokens: int = 0
    tier_disk_tokens: int = 0
    tier_host_tokens_per_s: float = DEFAULT_HOST_TOKENS_PER_S
    tier_disk_tokens_per_s: float = DEFAULT_DISK_TOKENS_PER_S


@dataclass(frozen=True)
class FleetSpec:
    """`workers` ≥ 1 workers drawn from `classes` (at least one, distinct names)."""

    workers: int
    classes: tuple[WorkerClass, ...] = (WorkerClass("worker", 1.0),)

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError("a fleet needs at least 1 worker")
        names = [c.name for c in self.classes]
        if not names or len(set(names)) != len(names):
            raise ValueError(f"a fleet needs worker classes with distinct names, not {names}")

    def counts(self) -> dict[str, int]:
        """Workers per class: proportional to the fractions, summing to `workers`."""
        total = sum(c.fraction for c in self.classes)
        exact = [self.workers * c.fraction / total for c in self.classes]
        counts = [int(x) for x in exact]
        by_remainder = sorted(range(len(exact)), key=lambda i: (counts[i] - exact[i], i))
        for i in by_remainder[: self.workers - sum(counts)]:
            counts[i] += 1
        return {c.name: n for c, n in zip(self.classes, counts)}

    def expand(self, figures: WorkerFigures) -> list[WorkerSpec]:
        """Every worker, classes in order; limits a class leaves open come from `figures`."""
        base = StepCost.from_calibration(figures.calibration)
        specs = []
        for worker_class, count in zip(self.classes, self.counts().values()):
            c = worker_class
            cal = figures.calibration
            scaled = CalibrationFigures(
                cal.prefill_tokens_per_s * c.speed,
                cal.decode_tokens_per_s * c.speed,
                cal.batched_decode_tokens_per_s * c.speed,
                cal.batch,
            )
            for i in range(count):
                specs.append(
                    WorkerSpec(
                        worker_id=f"{c.name}-{i:05d}",
                        worker_class=c.name,
                        cost=base.scaled(c.speed),
                        calibration=scaled,
                        kv_tokens=c.kv or figures.kv_tokens or DEFAULT_KV_TOKENS,
                        max_num_seqs=c.seqs or figures.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
                        max_num_batched_tokens=c.batch_tokens,
                        max_model_len=c.max_len or figures.max_model_len or DEFAULT_MAX_MODEL_LEN,
                        mtbf_s=c.mtbf,
                        repair_s=c.repair,
                        host=f"{c.name}-host-{i // c.per_host:05d}",
                        threads=c.threads,
                        host_cores=c.cores or c.per_host * c.threads,
                        tier_host_tokens=c.tier_host,
                        tier_disk_tokens=c.tier_disk,
                        tier_host_tokens_per_s=c.tier_host_rate,
                        tier_disk_tokens_per_s=c.tier_disk_rate,
                    )
                )
        return specs

    def as_dict(self) -> dict:
        return {
            "workers": self.workers,
            "counts": self.counts(),
            "classes": [dataclasses.asdict(c) for c in self.classes],
        }


def parse_mix(text: str) -> tuple[WorkerClass, ...]:
    """`NAME:FRACTION[:KEY=VALUE,...];...` → the classes; ValueError says what is wrong."""
    classes = []
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        pieces = part.split(":")
        if len(pieces) not in (2, 3):
            raise ValueError(f"{part!r} is not NAME:FRACTION[:KEY=VALUE,...]")
        raw: dict = {"name": pieces[0].strip(), "fraction": pieces[1].strip()}
        for option in (o.strip() for o in (pieces[2].split(",") if len(pieces) == 3 else ()) if o.strip()):
            key, equals, value = option.partition("=")
            if not equals:
                raise ValueError(f"{option!r} in {part!r} is not KEY=VALUE")
            raw[key.strip()] = value.strip()
        classes.append(WorkerClass.from_mapping(raw))
    if not classes:
        raise ValueError("the mix names no worker class")
    return tuple(classes)


def load_fleet(path: Path, workers: int | None = None) -> FleetSpec:
    """A fleet from YAML; `workers` overrides the file's count."""
    import yaml

    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping with `workers` and `classes`")
    unknown = sorted(set(raw) - {"workers", "classes"})
    if unknown:
        raise ValueError(f"{path}: unknown keys {unknown}; known: ['classes', 'workers']")
    classes = raw.get("classes") or [{"name": "worker", "fraction": 1.0}]
    if not isinstance(classes, list) or not all(isinstance(c, dict) for c in classes):
        raise ValueError(f"{path}: `classes` must be a list of mappings")
    count = workers if workers is not None else raw.get("workers")
    if not isinstance(count, int):
        raise ValueError(f"{path}: `workers` must be an integer (or give --workers)")
    return FleetSpec(count, tuple(WorkerClass.from_mapping(c) for c in classes))
