"""How long one engine step takes: a roofline-shaped model calibrated from three measured figures.

A step runs every scheduled token through the model once. Up to some number of tokens, a step costs
about the same whatever it carries (the weights are streamed from memory once per step: the
floor); beyond it, compute dominates and the cost grows with the tokens. Each decoding sequence
also pays for its own attention and sampling. So

    step_s = max(floor_s, (prefill_tokens + decode_seqs) * token_s) + decode_seqs * seq_s

Three calibration figures fix the three coefficients (see `StepCost.from_calibration`): the prefill
rate over one long prompt gives token_s (that step is compute-bound), the single-stream decode
rate gives floor_s + seq_s, and the batched decode rate at batch B gives the growth per sequence.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

# The prompt length of shoal.engine.calibration.calibrate's prefill measurement (its default).
CALIBRATION_PROMPT_TOKENS = 256


@dataclass(frozen=True)
class CalibrationFigures:
    """What a worker's start-up calibration measured (the fields of the engine's Calibration):
    prefill tokens/s over one CALIBRATION_PROMPT_TOKENS-token prompt, single-stream decode tokens/s,
    and aggregate decode tokens/s with `batch` sequences. Invariant: every figure is positive."""

    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    batched_decode_tokens_per_s: float
    batch: int

    def __post_init__(self) -> None:
        if min(self.prefill_tokens_per_s, self.decode_tokens_per_s, self.batched_decode_tokens_per_s) <= 0:
            raise ValueError("calibration speeds must be positive")
        if self.batch < 1:
            raise ValueError("the calibration batch must be at least 1")

    @classmethod
    def from_dict(cls, raw: dict) -> CalibrationFigures:
        """From a Calibration.as_dict() (the worker's /load `calibration`, or its cached JSON file)."""
        try:
            return cls(
                float(raw["prefill_tokens_per_s"]),
                float(raw["decode_tokens_per_s"]),
                float(raw["batched_decode_tokens_per_s"]),
                int(raw["batch"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"not a calibration ({type(exc).__name__}: {exc}); expected prefill_tokens_per_s, "
                "decode_tokens_per_s, batched_decode_tokens_per_s and batch"
            ) from None

    def rescaled(
        self, prefill_tokens_per_s: float, decode_step_s: float, decode_tokens_per_s: float
    ) -> CalibrationFigures:
        """The same worker at the speeds it measures while serving (the moving averages of its
        load report): prefill at the measured rate; decode steps as long as the measured step at
        the measured batch (decode tokens/s x step time), keeping the calibrated growth of the
        step with the batch."""
        batch = max(1.0, decode_tokens_per_s * decode_step_s)
        factor = StepCost.from_calibration(self).seconds(0, batch) / decode_step_s
        return CalibrationFigures(
            prefill_tokens_per_s,
            self.decode_tokens_per_s * factor,
            self.batched_decode_tokens_per_s * factor,
            self.batch,
        )

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class StepCost:
    """Coefficients of the step time formula above, in seconds, for a worker at speed 1.
    Invariant: all non-negative and floor_s > 0."""

    floor_s: float
    token_s: float
    seq_s: float

    @classmethod
    def from_calibration(cls, figures: CalibrationFigures, prompt_tokens: int = CALIBRATION_PROMPT_TOKENS) -> StepCost:
        """The coefficients that reproduce the three figures exactly: the prefill step (prompt_tokens,
        no decode) takes prompt_tokens / prefill rate; a decode step of one sequence 1 / single rate;
        of `batch` sequences batch / batched rate."""
        token_s = 1.0 / figures.prefill_tokens_per_s
        single_s = 1.0 / figures.decode_tokens_per_s
        batch = figures.batch
        batched_s = batch / figures.batched_decode_tokens_per_s
        if batch == 1:
            return cls(max(single_s, token_s), token_s, 0.0)
        seq_s = max(0.0, (batched_s - single_s) / (batch - 1))
        floor_s = single_s - seq_s
        if floor_s < batch * token_s:  # the batched step was compute-bound: it says seq_s directly
            seq_s = max(0.0, min(batched_s / batch - token_s, single_s - token_s))
            floor_s = single_s - seq_s
        return cls(max(floor_s, token_s), token_s, seq_s)

    def seconds(self, prefill_tokens: float, decode_seqs: float) -> float:
        return max(self.floor_s, (prefill_tokens + decode_seqs) * self.token_s) + decode_seqs * self.seq_s

    def scaled(self, speed: float) -> StepCost:
        """The same hardware `speed` times faster."""
        return StepCost(self.floor_s / speed, self.token_s / speed, self.seq_s / speed)

    def as_dict(self) -> dict:
        return asdict(self)
