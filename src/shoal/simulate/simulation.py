"""One simulated run: a fleet, a workload and a routing policy, from the first arrival until every
request has an outcome."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.bench.arrivals import ArrivalProcess
from shoal.bench.workloads import WorkloadConfig, build_workload
from shoal.simulate.calibration import DEFAULT_FIGURES, WorkerFigures
from shoal.simulate.clients import Clients
from shoal.simulate.events import EventLoop
from shoal.simulate.failures import FailureProcess
from shoal.simulate.fleet import FleetSpec
from shoal.simulate.host import Host
from shoal.simulate.metrics import RequestOutcome, SimSummary, summarize
from shoal.simulate.router import RouterSettings, SimRouter
from shoal.simulate.tokens import SimRequest, sim_requests
from shoal.simulate.worker import SimWorker


@dataclass(frozen=True)
class SimulationConfig:
    """Everything a run depends on; the same config gives the same result. `seed` drives the
    router's random choices, the report phases and the failures (the workload has its own seed);
    `request_overhead_s` is the time from a client's send to the router (see Clients)."""

    fleet: FleetSpec
    workload: WorkloadConfig
    arrivals: ArrivalProcess
    router: RouterSettings = RouterSettings()
    figures: WorkerFigures = DEFAULT_FIGURES
    seed: int = 0
    request_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.request_overhead_s < 0:
            raise ValueError("the request overhead cannot be negative")

    def with_policy(self, policy: str) -> SimulationConfig:
        return dataclasses.replace(self, router=dataclasses.replace(self.router, policy=policy))

    def as_dict(self) -> dict:
        return {
            "fleet": self.fleet.as_dict(),
            "workload": self.workload.as_dict(),
            "arrivals": dataclasses.asdict(self.arrivals),
            "router": dataclasses.asdict(self.router),
            "figures": self.figures.as_dict(),
            "seed": self.seed,
            "request_overhead_s": self.request_overhead_s,
        }


@dataclass(frozen=True)
class SimulationResult:
    """A run's summary and outcomes (in workload order), with what it cost to simulate."""

    policy: str
    summary: SimSummary
    outcomes: list[RequestOutcome]
    events: int
    wall_s: float


def workload_requests(config: SimulationConfig) -> list[SimRequest]:
    return sim_requests(build_workload(config.workload, config.arrivals))


def simulate(config: SimulationConfig, requests: Sequence[SimRequest] | None = None) -> SimulationResult:
    """Runs the workload (built from the config unless given) over a fresh fleet."""
    started = time.perf_counter()
    requests = workload_requests(config) if requests is None else requests
    loop = EventLoop()
    clients = Clients(requests, config.arrivals.concurrency, loop, config.request_overhead_s)
    router = SimRouter(config.router, loop, config.seed, clients.done)
    failures = FailureProcess(loop, router, random.Random(f"{config.seed}/failures"))
    phases = random.Random(f"{config.seed}/reports")
    hosts: dict[str, Host] = {}
    for spec in config.fleet.expand(config.figures):
        if spec.host not in hosts:
            hosts[spec.host] = Host(spec.host, spec.host_cores, loop)
        worker = SimWorker(spec, hosts[spec.host], loop, router, config.router.kv_event_lag_s is not None)
        router.join(worker, phases.uniform(0, config.router.report_interval_s))
        failures.watch(worker)
    clients.connect(router)
    with _collector_paused():
        loop.run()
    outcomes = [clients.outcomes[r.index] for r in requests]
    return SimulationResult(
        config.router.policy,
        summarize(outcomes, failures.failures),
        outcomes,
        loop.events_run,
        time.perf_counter() - started,
    )


@contextlib.contextmanager
def _collector_paused():
    """The cycle collector off for the run: the simulation makes millions of short-lived, acyclic
    objects (reference counting frees them), and scanning its many live ones costs a quarter of
    the run's time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
