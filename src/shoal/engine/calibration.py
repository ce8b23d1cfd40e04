"""Start-up calibration: a few real requests through the engine measure what this replica can do.

It doubles as the warm-up (first-call kernel set-up happens here, not in a client's request) and as
proof that generation works before the replica says it is ready.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass

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
        return {"prefill_tokens_per_s": self.prefill_tokens_per_s, "decode_tokens_per_s": self.decode_tokens_per_s,
                "batched_decode_tokens_per_s": self.batched_decode_tokens_per_s, "batch": self.batch,
                "seconds": self.seconds, "capability": self.capability}


def calibrate(engine: LLMEngine, prompt_tokens: int = 256, decode_steps: int = 8, batch: int = 8) -> Calibration:
    """Runs on an idle engine; leaves it idle with its counters reset. Prompts are random token ids,
    so the prefix cache cannot flatter the prefill figure."""
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
    prefill_started = time.perf_counter()
    run([prompt(prompt_tokens)], 1)
    prefill = prompt_tokens / (time.perf_counter() - prefill_started)
    single = decode_steps / run([prompt(16)], decode_steps + 1)
    batched = batch * decode_steps / run([prompt(16) for _ in range(batch)], decode_steps + 1)
    engine.reset_counters()
    engine.speed = SpeedEstimator(engine.speed.decay)
    engine.speed.seed(prefill, batched, batch / batched)
    return Calibration(prefill, single, batched, batch, time.perf_counter() - started)
