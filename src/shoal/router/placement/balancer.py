"""Places requests: eligible workers, the policy's choice, and the bookkeeping that follows it
(prefix index and in-flight accounting). What a worker caches is read from its KV events where the
router follows them (exact, shoal.router.fleet.kv_event_feeds), else guessed (shoal.router.placement.prefix_index)."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import msgspec

from shoal.router.fleet.followed_caches import FollowedCaches
from shoal.router.fleet.membership import Membership
from shoal.router.fleet.worker_state import WorkerState
from shoal.router.placement.in_flight_prefixes import InFlightPrefixes
from shoal.router.placement.policies import Policy, eligible
from shoal.router.placement.policies.cost import Estimate, estimate
from shoal.router.placement.prefix_index import PrefixIndex
from shoal.router.placement.worker_roles import Phase, decode_tokens_on, for_phase
from shoal.router.views import RouteRequest, RoutingContext, WorkerView


class Placement(msgspec.Struct, frozen=True):
    """A routing decision: the worker, the ticket of its in-flight entry, and the prompt tokens
    estimated to be found in its prefix cache; the candidates and context it was chosen from; the
    prompt's blocks recorded in the prefix index for the worker, and the capacity they were
    recorded under."""

    worker: WorkerState
    ticket: int
    cached_tokens: int
    candidates: tuple[WorkerView, ...] = ()
    context: RoutingContext = msgspec.field(default_factory=RoutingContext)
    blocks: tuple[bytes, ...] = ()
    capacity_blocks: int = 0


class Balancer:
    """Invariant: every Placement returned has an in-flight entry on its worker until `release`.
    `placed`, when set, hears of every record made in the prefix index (a router group tells its
    other members).

    A request's prompt blocks are recorded for its worker when it is placed, and again when it is
    released: the worker frees them as the request ends, so they are its most recently freed blocks,
    the last its cache evicts (least recently freed first). A conversation's next turn, sent as the
    last one ends, finds its history recorded where it is still cached, however many other prompts
    the worker was sent while the turn ran.

    A server that reports no load (llama-cpp-python's, for one) is taken to keep the prompts of the
    last requests it was sent, as many as it has been seen serving at once: llama.cpp's server keeps
    one sequence's cache, and serves its queue in the order sent, so what it holds once the router's
    requests there are done is the last prompt sent. Its record is not renewed at a release (the
    one released is not the one it computes last), and it has no home beyond what it holds, nor
    eviction pressure: with room for one prompt every prompt evicts the previous, and a request sent
    back there finds nothing kept for it."""

    def __init__(
        self,
        policy: Policy,
        membership: Membership,
        seed: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.policy = policy
        self.membership = membership
        self.clock = clock
        self.prefix_index = PrefixIndex()
        self.in_flight = InFlightPrefixes()
        self.rng = random.Random(seed)
        self.decisions = 0
        self.placed: Callable[[str, tuple[bytes, ...], int], None] | None = None
        # What workers cache, followed from their KV events (shoal.router.fleet.followed_caches).
        self.followed: FollowedCaches | None = None

    def place(
        self, request: RouteRequest, exclude: frozenset[str] = frozenset(), phase: Phase = "prefill"
    ) -> Placement | None:
        """None when no worker can take the request (unknown model, all unhealthy, too long).
        A continuation is placed in the decode phase (shoal.router.placement.worker_roles). Policies are pure
        functions of their arguments, so with one candidate none is asked: there is no choice."""
        found = self._candidates(request, exclude, phase)
        if found is None:
            return None
        candidates, context = found
        self.decisions += 1
        chosen = candidates[0] if len(candidates) == 1 else self.policy.choose(request, candidates, context)
        cached = context.cached_tokens(request, chosen)
        capacity_blocks = self._capacity_blocks(request, chosen)
        self._record(chosen.worker_id, request.prefix_blocks, capacity_blocks)
        if self.followed is not None:
            self.in_flight.sent(chosen.worker_id, request.prefix_blocks)
        state = self.membership.workers[chosen.worker_id]
        state.breaker.take(time.monotonic())
        ticket = state.start(request.prompt_tokens - cached, decode_tokens_on(chosen, request.expected_decode_tokens))
        return Placement(state, ticket, cached, tuple(candidates), context, request.prefix_blocks, capacity_blocks)

    def best_estimate(self, request: RouteRequest) -> Estimate | None:
        """The cost model's best prediction for the request now, over the workers that could take it:
        the cheapest that meets its targets, else the one with the shortest time to first token;
        None where no worker could take it."""
        found = self._candidates(request, frozenset(), "prefill")
        if found is None:
            return None
        candidates, context = found
        predicted = [estimate(request, w, candidates, context) for w in candidates]
        meeting = [e for e in predicted if e.meets(request)]
        return min(meeting, key=lambda e: e.seconds) if meeting else min(predicted, key=lambda e: e.ttft_s)

    def _candidates(
        self, request: RouteRequest, exclude: frozenset[str], phase: Phase
    ) -> tuple[list[WorkerView], RoutingContext] | None:
        """The workers that could take the request, and what policies know of them for it."""
        views = [w for w in self.membership.views() if w.worker_id not in exclude]
        candidates = eligible(request, for_phase(views, request, phase))
        if not candidates:
            return None
        matched = self.prefix_index.matched_blocks(request.prefix_blocks, [w.worker_id for w in candidates])
        in_tier = {
            w.worker_id: self.prefix_index.in_tier(
                w.worker_id,
                request.prefix_blocks[: matched[w.worker_id]],
                self._index_blocks(request, w.kv_capacity_tokens),
            )
            for w in candidates
            if w.kv_tier_tokens and matched[w.worker_id]
        }
        index = self.prefix_index
        placed = index.placed_blocks(request.prefix_blocks, [w.worker_id for w in candidates])
        unreported = {w.worker_id for w in candidates if w.served_concurrency is not None}
        for worker_id in unreported:
            placed[worker_id] = matched[worker_id]
        if self.followed is not None:
            self._read_followed(request, candidates, matched, in_tier, placed)
        pressure = index.eviction_pressure
        if unreported:

            def pressure(worker_id: str) -> float:
                return 0.0 if worker_id in unreported else index.eviction_pressure(worker_id)

        context = RoutingContext(self.rng, self.decisions, matched, in_tier, index.size, placed, pressure)
        return candidates, context

    def _read_followed(
        self,
        request: RouteRequest,
        candidates: list[WorkerView],
        matched: dict[str, int],
        in_tier: dict[str, int],
        placed: dict[str, int],
    ) -> None:
        """Where a worker's KV events are followed, what it holds replaces the guess: the prompt's
        leading blocks it holds, or was just sent (shoal.router.placement.in_flight_prefixes), and of those
        the ones only its tier holds. Where it was sent before stays the guess's."""
        now = self.clock()
        holding = self.followed.holding(request.prefix_blocks)
        for worker in candidates:
            state = self.followed.state_of(worker.worker_id, now)
            if state is None:
                continue
            held, below_device = state.matched(request.prefix_blocks) if worker.worker_id in holding else (0, 0)
            held = max(held, self.in_flight.leading(worker.worker_id, request.prefix_blocks, now))
            matched[worker.worker_id] = held
            in_tier.pop(worker.worker_id, None)
            if below_device:
                in_tier[worker.worker_id] = below_device
            placed[worker.worker_id] = max(placed[worker.worker_id], held)

    def _record(self, worker_id: str, blocks: tuple[bytes, ...], capacity_blocks: int) -> None:
        self.prefix_index.record(worker_id, blocks, capacity_blocks)
        if self.placed is not None:
            self.placed(worker_id, blocks, capacity_blocks)

    @classmethod
    def _capacity_blocks(cls, request: RouteRequest, worker: WorkerView) -> int:
        """The prefix index's capacity for the worker, in blocks: what its KV cache and tier hold;
        for a server that reports no load, this prompt's blocks times the requests it has been seen
        serving at once (the class docstring)."""
        if worker.served_concurrency is not None:
            return max(1, len(request.prefix_blocks)) * worker.served_concurrency
        return cls._index_blocks(request, (worker.kv_capacity_tokens or 1 << 20) + (worker.kv_tier_tokens or 0))

    @staticmethod
    def _index_blocks(request: RouteRequest, tokens: int | None) -> int:
        """The prefix index's blocks (of characters) that `tokens` KV tokens hold."""
        return int((tokens or 1 << 20) * request.chars_per_token / request.block_chars)

    def release(self, placement: Placement) -> None:
        placement.worker.finish(placement.ticket)
        worker = placement.worker
        if self.membership.workers.get(worker.worker_id) is worker:  # not gone since
            if not worker.reports_nothing:
                self._record(worker.worker_id, placement.blocks, placement.capacity_blocks)
            self.in_flight.ended(worker.worker_id, placement.blocks, self.clock())

    def forget(self, worker_id: str) -> None:
        self.prefix_index.forget(worker_id)
        self.in_flight.forget(worker_id)
