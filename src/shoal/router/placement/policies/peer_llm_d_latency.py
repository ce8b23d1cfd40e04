"""llm-d's predicted-latency (SLO-aware) scheduling, from its published description and its
scorer's documented rule: every worker gets a predicted time to first token and time per output
token for the request, and the request's targets (none: a target of 0, so every worker misses it)
give each a headroom, target minus prediction.

- An affinity gate first: where some workers hold at least 99% of the request's prefix blocks, the
  request is kept to them, except with probability EPSILON (exploration).
- Workers with headroom on both are preferred (with probability 1 - EPSILON when some have none):
  among them, after a second affinity gate at 80%, a weighted random draw that favours the least
  headroom (packing: weight 2 to 101 as the blend 0.8 x TTFT headroom + 0.2 x TPOT headroom,
  each normalised over the candidates, falls).
- Otherwise workers with no request in flight come first; among them (after the 80% gate) a
  weighted random draw that favours the smallest deficit (0.8 x TTFT + 0.2 x TPOT, normalised),
  workers missing both targets, then TTFT only, then TPOT only, each bucket weighted on its own.

Its predictor is an online-trained model of each worker's latency; here the predictions are the
cost model's (shoal.router.placement.policies.cost.estimate), so a comparison is of the rule,
not of the predictor. Shedding is the router's admission, as for every policy.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.router.placement.policies.cost import estimate
from shoal.router.views import RouteRequest, RoutingContext, WorkerView

EPSILON = 0.01
GLOBAL_AFFINITY = 0.99
AFFINITY = 0.80
TTFT_SHARE = 0.8  # of the headroom (and deficit) blend; TPOT takes the rest
POSITIVE_WEIGHTS = 100
NEGATIVE_WEIGHTS = 80


@dataclass(frozen=True)
class Prediction:
    """One worker for the request: its headrooms (seconds, target minus predicted), the share of
    the request's prefix blocks it holds, and whether it has any request in flight."""

    worker: WorkerView
    ttft_headroom: float
    tpot_headroom: float
    prefix: float
    busy: bool

    @property
    def meets(self) -> bool:
        return self.ttft_headroom > 0 and self.tpot_headroom > 0


def _gate(candidates: list[Prediction], threshold: float, rng: random.Random) -> list[Prediction]:
    """The candidates holding at least `threshold` of the prefix, unless none do or the draw explores."""
    sticky = [p for p in candidates if p.prefix >= threshold]
    if not sticky or rng.random() < EPSILON:
        return candidates
    return sticky


def _normalised(values: list[float], flat: float) -> list[float]:
    """Each value scaled to [0, 1] over the list; `flat` for each where they are all equal."""
    low, high = min(values), max(values)
    if high - low <= 1e-9:
        return [flat] * len(values)
    return [(v - low) / (high - low) for v in values]


def _weights(ttft: list[float], tpot: list[float], flat: float, span: int) -> list[int]:
    """Weights from 2 to span + 1, falling as the blend of the two normalised figures rises."""
    blend = zip(_normalised(ttft, flat), _normalised(tpot, flat), strict=True)
    return [int((1 - (TTFT_SHARE * a + (1 - TTFT_SHARE) * b)) * span) + 2 for a, b in blend]


@dataclass(frozen=True)
class LlmDPredictedLatency:
    name: str = "llm_d_latency"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView], context: RoutingContext) -> WorkerView:
        rng = context.rng
        candidates = _gate(self.predictions(request, workers, context), GLOBAL_AFFINITY, rng)
        positive = [p for p in candidates if p.meets]
        negative = [p for p in candidates if not p.meets]
        if positive and (not negative or rng.random() >= EPSILON):
            return self._least_headroom(positive, rng).worker
        return self._least_deficit(negative, rng).worker

    @staticmethod
    def predictions(request: RouteRequest, workers: Sequence[WorkerView], context: RoutingContext) -> list[Prediction]:
        blocks = len(request.prefix_blocks)
        found = []
        for w in workers:
            predicted = estimate(request, w, workers, context)
            found.append(
                Prediction(
                    w,
                    (request.ttft_target_s or 0.0) - predicted.ttft_s,
                    (request.tpot_target_s or 0.0) - predicted.tpot_s,
                    context.matched_blocks.get(w.worker_id, 0) / blocks if blocks else 0.0,
                    w.in_flight > 0,
                )
            )
        return found

    @staticmethod
    def _least_headroom(positive: list[Prediction], rng: random.Random) -> Prediction:
        candidates = _gate(positive, AFFINITY, rng)
        if len(candidates) == 1:
            return candidates[0]
        weights = _weights(
            [p.ttft_headroom for p in candidates], [p.tpot_headroom for p in candidates], 0.5, POSITIVE_WEIGHTS - 1
        )
        return rng.choices(candidates, weights)[0]

    @staticmethod
    def _least_deficit(negative: list[Prediction], rng: random.Random) -> Prediction:
        pool = [p for p in negative if not p.busy] or negative
        candidates = _gate(pool, AFFINITY, rng)
        if len(candidates) == 1:
            return candidates[0]
        buckets = (
            [p for p in candidates if p.ttft_headroom < 0 and p.tpot_headroom < 0],
            [p for p in candidates if p.ttft_headroom < 0 <= p.tpot_headroom],
            [p for p in candidates if p.tpot_headroom < 0 <= p.ttft_headroom],
        )
        chosen, weights = [], []
        for bucket in buckets:
            if bucket:
                chosen += bucket
                deficits = ([max(0.0, -p.ttft_headroom) for p in bucket], [max(0.0, -p.tpot_headroom) for p in bucket])
                weights += _weights(*deficits, 0.0, NEGATIVE_WEIGHTS)
        edge = [p for p in candidates if p.ttft_headroom >= 0 and p.tpot_headroom >= 0]
        return rng.choices(chosen + edge, weights + [1] * len(edge))[0]
