"""Start-up calibration: a few real requests through the engine measure what this replica can do.

It doubles as the warm-up (first-call kernel set-up happens here, not in a client's request) and as
proof that generation works before the replica says it is ready. The figures are kept in the cache
directory, keyed by everything they depend on (weights, dtype, device, threads, engine limits,
torch, the machine); a restart with the same key only warms up, so a replica is ready sooner.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import platform
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from shoal.engine.engine import LLMEngine
from shoal.engine.sampling_params import SamplingParams
from shoal.engine.speed import SpeedEstimator


@dataclass(frozen=True)
class Calibration:
    """Speeds measured at start-up. `capability` is the aggregate decode rate (tokens/s) with
    `batch` sequences running: the figure routers compare across heterogeneous replicas."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    batched_decode_tokens_per_s: float
    batch: int
    seconds: float

    @property
    def capability(self) -> float:
        return self.batched_decode_tokens_per_s

    def as_dict(self) -> dict:
        return {
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "decode_tokens_per_s": self.decode_tokens_per_s,
            "batched_decode_tokens_per_s": self.batched_decode_tokens_per_s,
            "batch": self.batch,
            "seconds": self.seconds,
            "capability": self.capability,
        }


def calibration_path(engine: LLMEngine, cache_root: Path) -> Path:
    """Where this engine's figures are kept: one file per key."""
    cpu = platform.processor() or platform.machine()
    identity = json.dumps(
        [
            engine.checkpoint.source,
            str(engine.dtype),
            str(engine.device),
            torch.get_num_threads(),
            dataclasses.asdict(engine.config),
            torch.__version__,
            cpu,
            os.cpu_count(),
            torch.cuda.get_device_name(engine.device) if engine.device.type == "cuda" else None,
        ],
        sort_keys=True,
        default=str,
    )
    return cache_root / "calibration" / f"{hashlib.sha256(identity.encode()).hexdigest()[:32]}.json"


def calibrate(
    engine: LLMEngine, cache_path: Path | None = None, prompt_tokens: int = 256, decode_steps: int = 8, batch: int = 8
) -> Calibration:
    """Runs on an idle engine; leaves it idle with its counters reset and its speed estimates seeded.
    With `cache_path` holding figures, they are reused after a warm-up; without, they are measured
    (and written there). Prompts are random token ids, so the prefix cache cannot flatter prefill."""
    assert not engine.has_unfinished_requests(), "calibrate an idle engine"
    started = time.perf_counter()
    rng = random.Random(0)
    vocab = engine.model.config.vocab_size
    room = min(engine.max_model_len, engine.max_cached_tokens)
    prompt_tokens = max(1, min(prompt_tokens, engine.config.max_num_batched_tokens, room // 2))
    batch = max(1, min(batch, engine.config.max_num_seqs, room // (2 * (16 + decode_steps + 1))))

    def prompt(length: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(length)]

    def run(prompts: list[list[int]], max_tokens: int) -> float:
        """Seconds spent on the decode steps (every step after the one that samples the first tokens)."""
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        for i, ids in enumerate(prompts):
            engine.add_request(f"calibration-{time.monotonic_ns()}-{i}", ids, params)
        answered: set[str] = set()
        decode_started = time.perf_counter()
        while engine.has_unfinished_requests():
            outputs = engine.step()
            if len(answered) < len(prompts):
                answered.update(o.request_id for o in outputs)
                decode_started = time.perf_counter()
        return time.perf_counter() - decode_started

    run([prompt(8)], 2)  # warm-up
    known = _read(cache_path)
    if known is not None:
        run([prompt(16) for _ in range(known.batch)], 2)  # warms the batched path too
        prefill, single, batched, batch = (
            known.prefill_tokens_per_s,
            known.decode_tokens_per_s,
            known.batched_decode_tokens_per_s,
            known.batch,
        )
    else:
        prefill_started = time.perf_counter()
        run([prompt(prompt_tokens)], 1)
        prefill = prompt_tokens / (time.perf_counter() - prefill_started)
        single = decode_steps / run([prompt(16)], decode_steps + 1)
        batched = batch * decode_steps / run([prompt(16) for _ in range(batch)], decode_steps + 1)
    engine.reset_counters()
    engine.speed = SpeedEstimator(engine.speed.decay)
    engine.speed.seed(prefill, batched, batch / batched)
    calibration = Calibration(prefill, single, batched, batch, time.perf_counter() - started)
    if cache_path is not None and known is None:
        _write(cache_path, calibration)
    return calibration


def _read(path: Path | None) -> Calibration | None:
    try:
        raw = json.loads(path.read_text()) if path is not None else None
        return (
            Calibration(
                raw["prefill_tokens_per_s"],
                raw["decode_tokens_per_s"],
                raw["batched_decode_tokens_per_s"],
                int(raw["batch"]),
                0.0,
            )
            if raw
            else None
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing or unreadable: measure again


def _write(path: Path, calibration: Calibration) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_suffix(f".{os.getpid()}.tmp")
        temporary.write_text(json.dumps(calibration.as_dict()))
        temporary.replace(path)
    except OSError:
        pass  # a read-only cache only costs the next start its measurement
