"""Where a simulated worker's figures come from: a live shoal worker's /load report, a JSON file
(a saved /load report or the engine's cached calibration), or the defaults below."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec

from shoal.protocol.worker_load import WorkerLoad
from shoal.simulate.cost_model import CalibrationFigures

# A SmolLM2-135M-Instruct worker on one core of a 2-core Xeon (AVX512-BF16/AMX) machine: bfloat16,
# --num-threads 1, 256MiB KV cache, its start-up calibration measured alone (docs/simulation.md).
SMOLLM2_CPU = CalibrationFigures(
    prefill_tokens_per_s=760.0, decode_tokens_per_s=23.7, batched_decode_tokens_per_s=172.0, batch=8
)


@dataclass(frozen=True)
class WorkerFigures:
    """A worker as measured: its speeds, and the engine limits its load report states (None where
    the source does not say). `source` says where they came from."""

    calibration: CalibrationFigures
    kv_tokens: int | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    source: str = "defaults (SmolLM2-135M, CPU, 1 thread)"

    @classmethod
    def from_report(cls, report: dict, source: str) -> WorkerFigures:
        """From a shoal worker's /load report: the speeds it measures now, that is its start-up
        calibration rescaled to the moving averages of its recent steps (for a worker that has not
        served yet, the calibration itself). A bare calibration dict is taken as it is."""
        if "calibration" not in report:
            return cls(CalibrationFigures.from_dict(report), source=source)
        try:
            load = msgspec.convert(report, WorkerLoad)
        except msgspec.ValidationError as exc:
            raise ValueError(f"{source} is not a shoal load report: {exc}") from None
        if load.calibration is None:
            raise ValueError(f"{source} reports no calibration")
        calibration = CalibrationFigures.from_dict(msgspec.to_builtins(load.calibration))
        live = (load.prefill_tokens_per_s, load.decode_step_s, load.decode_tokens_per_s)
        if all(live):
            calibration = calibration.rescaled(*live)
        kv = load.num_kv_blocks * load.block_size if load.num_kv_blocks and load.block_size else None
        return cls(calibration, kv, load.max_num_seqs, load.max_model_len, source)

    def as_dict(self) -> dict:
        return {
            "calibration": self.calibration.as_dict(),
            "kv_tokens": self.kv_tokens,
            "max_num_seqs": self.max_num_seqs,
            "max_model_len": self.max_model_len,
            "source": self.source,
        }


def average(figures: Sequence[WorkerFigures]) -> WorkerFigures:
    """One typical worker of several: the mean of each speed (at the first one's calibration batch),
    the first one's limits."""
    first = figures[0]
    if len(figures) == 1:
        return first

    def mean(name: str) -> float:
        return sum(getattr(f.calibration, name) for f in figures) / len(figures)

    calibration = CalibrationFigures(
        mean("prefill_tokens_per_s"),
        mean("decode_tokens_per_s"),
        mean("batched_decode_tokens_per_s"),
        first.calibration.batch,
    )
    return replace(
        first,
        calibration=calibration,
        source=f"the mean of {len(figures)}: " + ", ".join(sorted({f.source for f in figures})),
    )


DEFAULT_FIGURES = WorkerFigures(SMOLLM2_CPU)


def read_figures(source: str, timeout_s: float = 10.0) -> WorkerFigures:
    """`http(s)://host:port` reads that worker's /load; anything else is a JSON file. Raises
    ValueError (or OSError/httpx errors for unreachable sources) with the reason."""
    if source.startswith(("http://", "https://")):
        import httpx  # only when a live worker is asked

        url = source.rstrip("/").removesuffix("/load") + "/load"
        response = httpx.get(url, timeout=timeout_s)
        response.raise_for_status()
        return WorkerFigures.from_report(response.json(), url)
    try:
        raw = json.loads(Path(source).read_text())
    except ValueError as exc:
        raise ValueError(f"{source} is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{source} holds no JSON object")
    return WorkerFigures.from_report(raw, source)
