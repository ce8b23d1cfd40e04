"""The default policy: send the request where it is estimated to finish first.

Workers batch continuously: a new request does not wait for the running ones to finish, it joins
their batch and every sequence's steps get slower. So for a worker, the estimate is

    time = work queued ahead of this request's prefill  (outstanding prompt tokens / prefill speed,
           plus, when the batch is full or the free KV cache cannot hold the request, the wait
           for a running request to end: a running request's remaining decode tokens x per-token
           time)
         + this request's uncached prompt tokens / prefill speed
         + its expected decode tokens x per-token time

per-token time = max(decode step time, (running + 1) / decode throughput): the step time the
batch has now, or the batch's share of the worker's aggregate decode rate once it is saturated.

A placement also costs the requests already running there: steps are shared, so while this
request's prompt is computed none of them advances. Each is delayed by about the prefill's time,
and the estimate adds that for every running request. With it, the sum over requests is what is
minimised, not this request's time alone: a busy worker holding only a shared system prompt no
longer looks cheaper than an idle one for a new conversation (a herd whose caches then overflow),
and a conversation is not moved to recompute its whole history beside other streams.

Figures from start-up calibration and figures measured since are both kept, and where a measured
one is far better (CALIBRATION_DOUBT) it is believed: an idle worker's step is its calibrated
single-stream step unless its last measured step is far shorter (a step at any batch takes no less
than one at batch 1), and its throughput the calibrated aggregate rate unless the rate it has
reached since is far higher (a rate reached is a rate it can do). Errors are not symmetric: a
worker estimated too fast gets work and is measured again, one estimated too slow gets none and
would keep its figures forever. So a calibration taken while other processes had the CPU no longer
exiles a worker that has since shown its speed. A worker that has generated nothing since it started
has only its calibration, which may be just as wrong: while idle, and for a request no worker holds
a cached prefix of, it is taken to be as fast as the fleet's fastest idle worker, so it gets such a
request when the others are busy and is measured by it. An estimate too fast costs one request; one
too slow would starve it for good. A conversation is never moved off its cache to try a worker.

Estimates are noisy (speeds move with batch size and with whatever else shares the machine), so
affinity gets a margin: the worker holding the longest cached prefix keeps the request unless
another is estimated faster by more than the margin. Where no worker is believed to hold more of
the prompt than the others, the worker the longest prefix was last sent to is its home: when caches
hold only a few conversations, each evicts what it was sent a while ago, and a prefix sent back to
where it went before keeps a system prompt's conversations together, where the next ones find it
cached, instead of spreading every prefix over every cache. Under such KV pressure the margin
widens with the home's eviction pressure (how many times over its cache it was sent blocks it could
not keep lately, up to 4; PRESSURE_MARGIN per time): a request moved off its home there recomputes
its prefix in a cache that has no room for it, evicting as much of what that cache's own requests
come back for, and leaves its copy at home as dead weight; an estimate that looks faster now pays
for it in the turns that follow. A cache that holds its traffic has no pressure and the margin
above. In the simulator, two workers whose caches hold about two conversations each, six system
prompts, four conversations at a time: hit rate 0.40 with the noise margin alone, 0.54 with it,
as SGLang's rule, at a lower TTFT p99. Without it, identical workers trade
conversations on noise and every trade re-computes a whole history; with too wide a one,
conversations stay on workers whose caches overflow. The margin is the two workers' decode step
noise added (how far each one's steps fall from the step it reports, relative to it), at least
`min_affinity_margin` (10%); a worker that does not report its noise is taken at 12.5%, so two such
workers keep the 25% that served before the noise was measured. Two one-thread workers on two cores
beside their router and its client measured 11-24% each; the simulator's workers, whose steps move
only with their batch, about 1%.

Load (queue and batch), cache (uncached tokens only) and hardware (each worker's own measured
speeds) enter one formula: a worker twice as fast has per-token times half as long at the same
batch, so it is picked until its batch is about twice as large. Speeds a worker does not report are
taken as the fleet's median, so unknown workers are treated as typical rather than as free; a server
that reports nothing shows the speeds the router has measured there instead, once it has
(shoal.router.fleet.served_concurrency), and is believed to cache only the last prompts it was sent
(shoal.router.placement.balancer).

A server that reports no load at all may serve one request at a time and queue the rest
(llama-cpp-python does): the router's requests there beyond what it has been seen serving at once
(shoal.router.fleet.served_concurrency) wait a service time each (the mean seen, or this request's own
estimate before any; at least what the oldest there has taken so far), divided among those it
serves. Before such a server has ended one of the router's streams, how long a request queued there
waits is unknown (llama.cpp's first can take many seconds): it takes a second request only when every
worker would queue it blind, so an opening burst does not pile onto it. A server given only
non-streamed requests is never measured this way and stays at one request while others have room.
A prefill worker generates only the first token (it hands the rest off), so only that counts
there. Cached tokens in a worker's KV tier cost the time to copy them back (shoal.router.placement.tier_cost).

A request for a LoRA adapter costs, where the worker does not hold the adapter in memory, the time
to read it (adapter_seconds), and a worker holding it is its home as a cached prefix is (the margin
above). So such requests go where the adapter is hot, unless that worker is busier than a read and
the margin; as an adapter's traffic grows, its holders get busy and the next request is placed on a
worker that then loads it: a popular adapter spreads over the fleet by itself.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from shoal.router.placement.policies.base import lacks_kv_room
from shoal.router.placement.tier_cost import tier_seconds
from shoal.router.placement.worker_roles import decode_tokens_on
from shoal.router.views import RouteRequest, RoutingContext, WorkerView

DEFAULT_PREFILL_TOKENS_PER_S = 1000.0
DEFAULT_DECODE_TOKENS_PER_S = 100.0
DEFAULT_DECODE_STEP_S = 0.05


@dataclass(frozen=True)
class Speeds:
    prefill_tokens_per_s: float
    decode_tokens_per_s: float
    decode_step_s: float


def _median_or(values: list[float | None], default: float) -> float:
    known = [v for v in values if v]
    return statistics.median(known) if known else default


# A measured figure this many times better than the calibrated one means the calibration was taken
# on a starved CPU; smaller gaps are the noise of a shared machine, where trusting whichever figure
# is luckier would move conversations off their caches.
CALIBRATION_DOUBT = 2.0


def decode_throughput(worker: WorkerView) -> float | None:
    """The calibrated aggregate decode rate, or the one measured since where it is far higher."""
    calibrated, measured = worker.capability, worker.decode_tokens_per_s
    if calibrated and measured and measured > CALIBRATION_DOUBT * calibrated:
        return measured
    return calibrated or measured


def idle_step_s(worker: WorkerView) -> float | None:
    """The calibrated single-stream step, or the last measured step where it is far shorter."""
    calibrated, measured = worker.single_step_s, worker.decode_step_s
    if calibrated and measured and measured * CALIBRATION_DOUBT < calibrated:
        return measured
    return calibrated or measured


def fastest_idle_step_s(fleet: Sequence[WorkerView]) -> float | None:
    """The shortest step any worker of the fleet would take idle (its `idle_step_s`), busy or not now."""
    known = [step for step in map(idle_step_s, fleet) if step]
    return min(known) if known else None


def speeds(worker: WorkerView, fleet: Sequence[WorkerView]) -> Speeds:
    """The worker's measured speeds, the fleet's median where it has none, defaults if nobody has.
    The step borrowed is the fleet's idle one: the other workers' steps now are as long as their
    batches, and this worker's own batch is counted by the throughput term."""
    return Speeds(
        worker.prefill_tokens_per_s
        or _median_or([w.prefill_tokens_per_s for w in fleet], DEFAULT_PREFILL_TOKENS_PER_S),
        decode_throughput(worker) or _median_or([decode_throughput(w) for w in fleet], DEFAULT_DECODE_TOKENS_PER_S),
        worker.decode_step_s or _median_or([idle_step_s(w) for w in fleet], DEFAULT_DECODE_STEP_S),
    )


@dataclass(frozen=True)
class Estimate:
    """The cost model's prediction for a request on a worker: its time to first token, its time per
    output token after that, and what the placement costs in all (`seconds`, which policies minimise:
    the request's own time, and the delay it puts on those running there)."""

    ttft_s: float
    tpot_s: float
    seconds: float

    def meets(self, request: RouteRequest) -> bool:
        """Whether the request's latency targets (those it has) are predicted to be met."""
        return (request.ttft_target_s is None or self.ttft_s <= request.ttft_target_s) and (
            request.tpot_target_s is None or self.tpot_s <= request.tpot_target_s
        )


def estimated_seconds(
    request: RouteRequest, worker: WorkerView, fleet: Sequence[WorkerView], context: RoutingContext
) -> float:
    return estimate(request, worker, fleet, context).seconds


def estimate(
    request: RouteRequest, worker: WorkerView, fleet: Sequence[WorkerView], context: RoutingContext
) -> Estimate:
    """The request on `worker` by the cost model (see the module's docstring)."""
    speed = speeds(worker, fleet)
    if worker.served_concurrency is None:
        running = max(worker.running, worker.in_flight - worker.waiting)
    else:  # a server that reports no load: those it serves beside this one once it takes it
        running = min(worker.in_flight, worker.served_concurrency - 1)
    if running:
        step = speed.decode_step_s
    elif worker.unmeasured and not any(context.matched_blocks.values()):
        step = fastest_idle_step_s(fleet) or speed.decode_step_s
    else:
        step = idle_step_s(worker) or speed.decode_step_s
    # A worker that speculates gives a sequence decode_tokens_per_step tokens a step (its measured
    # acceptance): each token costs that much less of a step.
    per_token = max(step / max(1.0, worker.decode_tokens_per_step or 1.0), (running + 1) / speed.decode_tokens_per_s)
    uncached = request.prompt_tokens - context.cached_tokens(request, worker)
    decode_tokens = decode_tokens_on(worker, request.expected_decode_tokens)
    loading = tier_seconds(request, worker, context, speed.prefill_tokens_per_s)
    prefill = uncached / speed.prefill_tokens_per_s + loading
    before_first = adapter_seconds(request, worker, fleet) + prefill
    own = before_first + decode_tokens * per_token
    if worker.served_concurrency is not None:
        # a request there takes its mean, at least what the oldest there has taken so far
        ahead = turns_waited(worker) * max(worker.service_s or own, worker.busy_s or 0.0)
    else:
        ahead = worker.outstanding_prefill_tokens / speed.prefill_tokens_per_s
        if (worker.max_num_seqs and worker.load >= worker.max_num_seqs) or lacks_kv_room(request, worker):
            ahead += worker.outstanding_decode_tokens / max(running, 1) * per_token
    return Estimate(ahead + before_first, per_token, ahead + own + running * prefill)


# A LoRA adapter's read, where no worker of the fleet has measured one yet.
DEFAULT_ADAPTER_LOAD_S = 0.25


def adapter_seconds(request: RouteRequest, worker: WorkerView, fleet: Sequence[WorkerView]) -> float:
    """What the LoRA adapter the request names costs before its prefill: nothing where the worker
    holds it in memory, else a read of its files (the worker's measured seconds, else the fleet's
    median), twice where its memory is full: the adapter it gives back for this one is read again
    when next asked for there. A worker reads files off its engine thread, so the requests running
    there do not wait."""
    if request.adapter_of is None or request.model in worker.lora_held:
        return 0.0
    read = worker.lora_load_s or _median_or([w.lora_load_s for w in fleet], DEFAULT_ADAPTER_LOAD_S)
    full = worker.lora_capacity is not None and len(worker.lora_held) >= worker.lora_capacity
    return 2 * read if full else read


def turns_waited(worker: WorkerView) -> float:
    """For a server that reports no load: the requests' service times a new one waits, queued
    behind the router's requests beyond what the server has been seen serving at once."""
    slots = worker.served_concurrency or 1
    return max(0, worker.in_flight - slots + 1) / slots


def queues_blind(worker: WorkerView) -> bool:
    """A server that reports no load, has ended none of the router's streams yet, and would have to
    queue this request behind those it has been seen serving at once."""
    return (
        worker.served_concurrency is not None
        and worker.service_s is None
        and worker.in_flight >= worker.served_concurrency
    )


# The decode step noise taken for a worker that does not report it (a peer engine).
UNREPORTED_STEP_NOISE = 0.125
# The margin a home's eviction pressure adds, per time its cache was sent more than it could keep.
PRESSURE_MARGIN = 0.5


def affinity_margin(home: WorkerView, fastest: WorkerView, least: float, pressure: float = 0.0) -> float:
    """How much faster than `home` another worker must be estimated to take its request: the two
    workers' step noise added, at least `least`, and at least PRESSURE_MARGIN times the home's
    eviction pressure."""
    noise = sum(UNREPORTED_STEP_NOISE if w.decode_step_noise is None else w.decode_step_noise for w in (home, fastest))
    return max(least, noise, PRESSURE_MARGIN * pressure)


@dataclass(frozen=True)
class CostPolicy:
    min_affinity_margin: float = 0.10
    name: str = "cost"

    def choose(self, request: RouteRequest, workers: Sequence[WorkerView], context: RoutingContext) -> WorkerView:
        candidates = [w for w in workers if not queues_blind(w)] or workers
        predicted = {w.worker_id: estimate(request, w, workers, context) for w in candidates}
        # A request with latency targets goes where they are predicted to be met, if anywhere.
        candidates = [w for w in candidates if predicted[w.worker_id].meets(request)] or candidates
        estimates = {w.worker_id: predicted[w.worker_id].seconds for w in candidates}
        fastest = min(candidates, key=lambda w: (estimates[w.worker_id], w.worker_id))
        home = max(candidates, key=lambda w: (*affinity(request, w, context), -estimates[w.worker_id]))
        if (
            affinity(request, home, context) > affinity(request, fastest, context)
            and estimates[home.worker_id]
            <= (1 + affinity_margin(home, fastest, self.min_affinity_margin, context.eviction_pressure(home.worker_id)))
            * estimates[fastest.worker_id]
        ):
            return home
        return fastest


def affinity(request: RouteRequest, worker: WorkerView, context: RoutingContext) -> tuple[bool, int, int]:
    """What ties a request to a worker: the LoRA adapter it names held in memory there, the prefix
    it is believed to hold (an adapter's prefixes are its own: cached only where it ran), then the
    prefix last sent there (which a cache too small for its traffic may have evicted since)."""
    held = request.adapter_of is not None and request.model in worker.lora_held
    return held, context.matched_blocks.get(worker.worker_id, 0), context.placed_blocks.get(worker.worker_id, 0)
