"""Scales each autoscaled model's replicas from the load the router sees.

Signals per model (over its available workers): requests queued at the router plus waiting in the
workers, per replica; outstanding tokens per replica; mean KV-cache usage; and, while requests run,
the mean time to first token and inter-token latency the router measures. Pressure (any signal over
its target) held for upscale_delay_s adds a replica; quiet (every signal under half its target, the
hysteresis band) held for downscale_delay_s removes one; nothing changes while a replica is still
starting (its capacity is on the way). A model at zero replicas with a request
waiting gets one at once (the request waits for it); one with min_replicas 0 that has no request
at all for downscale_delay_s goes to zero.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from shoal.cluster.config import Autoscaling, ModelDeployment
from shoal.cluster.supervisor import Supervisor
from shoal.router.front_door import FrontDoor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Signals:
    replicas: int
    queued: int
    in_flight: int
    outstanding_tokens: int
    kv_cache_usage: float | None
    ttft_s: float | None
    itl_s: float | None
    starting: int = 0  # replicas not serving yet


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def ratios(signals: Signals, targets: Autoscaling) -> list[float]:
    """Each watched signal over its target (1.0 = at target)."""
    per_replica = max(signals.replicas, 1)
    pairs = [
        (signals.queued / per_replica, targets.target_queued_per_replica),
        (signals.outstanding_tokens / per_replica, targets.target_outstanding_tokens_per_replica),
        (signals.kv_cache_usage, targets.target_kv_cache_usage),
    ]
    if signals.in_flight:  # latencies of idle workers are stale
        pairs += [(signals.ttft_s, targets.target_ttft_s), (signals.itl_s, targets.target_itl_s)]
    return [value / target for value, target in pairs if value is not None and target is not None]


def describe(signals: Signals, targets: Autoscaling) -> str:
    """The watched signals against their targets, for the event feed and the log."""
    per_replica = max(signals.replicas, 1)
    named = [
        ("queued/replica", signals.queued / per_replica, targets.target_queued_per_replica, "{:.1f}"),
        (
            "outstanding tokens/replica",
            signals.outstanding_tokens / per_replica,
            targets.target_outstanding_tokens_per_replica,
            "{:.0f}",
        ),
        ("KV usage", signals.kv_cache_usage, targets.target_kv_cache_usage, "{:.2f}"),
    ]
    if signals.in_flight:
        named += [
            ("TTFT s", signals.ttft_s, targets.target_ttft_s, "{:.3f}"),
            ("ITL s", signals.itl_s, targets.target_itl_s, "{:.3f}"),
        ]
    parts = [
        f"{name} {form.format(value)} (target {target:g})"
        for name, value, target, form in named
        if value is not None and target is not None
    ]
    return ", ".join(parts) or "no request for a while"


@dataclass
class Trend:
    """Since when a model has been under pressure, quiet, or without any request (None: not now)."""

    pressure_since: float | None = None
    quiet_since: float | None = None
    idle_since: float | None = None


def decide(signals: Signals, targets: Autoscaling, trend: Trend, now: float) -> int:
    """The replicas the model should have now (updates `trend`)."""
    current = signals.replicas
    if current == 0:
        return 1 if signals.queued and targets.max_replicas else 0
    measured = ratios(signals, targets)
    pressure = any(r > 1 for r in measured)
    settled = not signals.starting  # a replica still starting is not a replica to spare
    quiet = settled and all(r < 0.5 for r in measured)
    idle = settled and not signals.in_flight and not signals.queued
    if not pressure:
        trend.pressure_since = None
    elif trend.pressure_since is None:
        trend.pressure_since = now
    if pressure or not quiet:
        trend.quiet_since = None
    elif trend.quiet_since is None:
        trend.quiet_since = now
    if not idle:
        trend.idle_since = None
    elif trend.idle_since is None:
        trend.idle_since = now
    if (
        pressure
        and settled
        and now - trend.pressure_since >= targets.upscale_delay_s
        and current < targets.max_replicas
    ):
        trend.pressure_since = None
        return current + 1
    if current == 1 and targets.min_replicas == 0:  # the last replica goes only when nothing comes
        quiet_enough = idle and now - trend.idle_since >= targets.downscale_delay_s
    else:
        quiet_enough = quiet and now - trend.quiet_since >= targets.downscale_delay_s
    if quiet_enough and current > targets.min_replicas:
        trend.quiet_since = trend.idle_since = None
        return current - 1
    return current


class Autoscaler:
    def __init__(
        self, deployments: list[ModelDeployment], supervisor: Supervisor, front_door: FrontDoor, interval_s: float = 0.5
    ):
        self.targets = {d.name: d.autoscaling for d in deployments if d.autoscaling}
        self.supervisor = supervisor
        self.front_door = front_door
        self.interval_s = interval_s
        self.trends = {name: Trend() for name in self.targets}

    def signals(self, model: str) -> Signals:
        workers = [w for w in self.front_door.membership.workers.values() if model in w.models and w.available]
        views = [w.view() for w in workers]
        reports = [w.report for w in workers if w.report is not None]
        queued_here = sum(
            1 for queue in self.front_door.admission.queues.values() for waiter in queue if waiter.model == model
        )
        return Signals(
            replicas=self.supervisor.replicas(model),
            queued=queued_here + sum(v.waiting for v in views),
            in_flight=sum(v.in_flight for v in views),
            outstanding_tokens=sum(v.outstanding_tokens for v in views),
            kv_cache_usage=_mean([r.kv_cache_usage for r in reports if r.kv_cache_usage is not None]),
            ttft_s=_mean([w.latency.ttft_s for w in workers if w.latency.ttft_s is not None]),
            itl_s=_mean([w.latency.itl_s for w in workers if w.latency.itl_s is not None]),
            starting=self.supervisor.starting(model),
        )

    def step(self, now: float) -> None:
        for model, targets in self.targets.items():
            signals = self.signals(model)
            wanted = decide(signals, targets, self.trends[model], now)
            if wanted != signals.replicas:
                log.info("autoscaling %s from %d to %d replicas (%s)", model, signals.replicas, wanted, signals)
                self.supervisor.scale(model, wanted, reason=describe(signals, targets))

    async def run(self) -> None:
        while True:
            self.step(time.monotonic())
            await asyncio.sleep(self.interval_s)
