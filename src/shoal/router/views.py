"""What a routing policy sees: the request (as the router understands it, without a tokenizer) and
one immutable view per worker. Policies are pure functions of these, so a simulator can drive them.
Requests and views are frozen msgspec structs: the router builds them on every request, and a struct
is built in a sixth of a frozen dataclass's time (msgspec.structs.replace changes a copy)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec

from shoal.router.load_figures import LoadFigures


class RouteRequest(msgspec.Struct, frozen=True):
    """One request to place.

    prompt_tokens is exact for token-id prompts and estimated from characters otherwise;
    expected_decode_tokens is max_tokens when given, else the model's typical completion length.
    prefix_blocks are chained hashes of the prompt's fixed-size text blocks (see prefix_index).
    """

    model: str
    prompt_tokens: int
    expected_decode_tokens: int
    prefix_blocks: tuple[bytes, ...] = ()
    chars_per_token: float = 4.0
    block_chars: int = 32
    session_key: str | None = None
    end_user: str | None = None  # OpenAI's safety_identifier, else user: its own rate limits
    priority: str = "standard"
    # Where `model` names a LoRA adapter: its base model, and whether a router may load it onto
    # workers of that base that load adapters on demand (shoal.router.lora_catalog).
    adapter_of: str | None = None
    adapter_loadable: bool = False
    # Latency targets (shoal.router.placement.latency_targets): seconds to the first token, and per token after.
    ttft_target_s: float | None = None
    tpot_target_s: float | None = None

    @property
    def loadable_of(self) -> str | None:
        """The base model of the LoRA adapter `model` names, where a router may load it."""
        return self.adapter_of if self.adapter_loadable else None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.expected_decode_tokens


def serves(model: str, loadable_of: str | None, models: frozenset[str], loads_adapters: bool) -> bool:
    """Whether a worker serving `models` serves `model`, or can load it first: a LoRA adapter a
    router loads onto workers of base `loadable_of`, on one that reads adapters at run time."""
    return model in models or (loadable_of is not None and loads_adapters and loadable_of in models)


class WorkerView(LoadFigures, frozen=True, kw_only=True):
    """A worker's state as the router knows it now: its figures (load_figures), with the router's own.

    Load figures merge the worker's latest report with the router's own accounting of what it sent
    since (whichever is larger), so a burst between two reports is not invisible. Speeds are None
    when neither a report nor calibration gave them. Invariant: all counts are non-negative.
    """

    worker_id: str
    url: str
    models: frozenset[str]
    healthy: bool = True
    in_flight: int = 0
    outstanding_prefill_tokens: int = 0
    outstanding_decode_tokens: int = 0
    # A server that reports no load: how many requests it has been seen serving at once, the mean
    # seconds one takes (shoal.router.fleet.served_concurrency) and how long the oldest of the router's
    # requests there has been served; None for one that reports its load.
    served_concurrency: int | None = None
    service_s: float | None = None
    busy_s: float | None = None

    def serves(self, request: RouteRequest) -> bool:
        return serves(request.model, request.loadable_of, self.models, self.lora_on_demand)

    @property
    def outstanding_tokens(self) -> int:
        return self.outstanding_prefill_tokens + self.outstanding_decode_tokens

    @property
    def load(self) -> int:
        """Requests on the worker (running, queued, or sent by this router and not yet reported)."""
        return max(self.running + self.waiting, self.in_flight)


@dataclass
class RoutingContext:
    """Everything a policy may use besides the request and the views: a random source (power of
    two choices), the router's request counter (round robin) and each worker's matched prefix length
    for this request, in blocks (cache-aware, cost), and how many of those are likely below its
    paged cache, in its KV tier; how many leading blocks were last sent to each worker, whether
    still cached there or not (prefix_index.placed_blocks: affinity), and how hard each worker's
    cache has been evicting lately (prefix_index.eviction_pressure). Built fresh per decision by
    the balancer."""

    rng: random.Random = field(default_factory=random.Random)
    sequence_number: int = 0
    matched_blocks: dict[str, int] = field(default_factory=dict)
    tier_blocks: dict[str, int] = field(default_factory=dict)  # of the matched, those likely in its KV tier
    recorded_blocks: Callable[[str], int] = lambda worker_id: 0  # the prefix index's size for a worker
    placed_blocks: dict[str, int] = field(default_factory=dict)  # leading blocks last sent there, cached or not
    eviction_pressure: Callable[[str], float] = lambda worker_id: 0.0  # prefix_index.eviction_pressure

    def cached_tokens(self, request: RouteRequest, worker: WorkerView) -> int:
        """Estimated prompt tokens the worker already holds in its prefix cache."""
        chars = self.matched_blocks.get(worker.worker_id, 0) * request.block_chars
        return min(request.prompt_tokens, int(chars / request.chars_per_token))

    def tier_tokens(self, request: RouteRequest, worker: WorkerView) -> int:
        """Of cached_tokens, those estimated to lie in the worker's KV tier (copied back, not free)."""
        chars = self.tier_blocks.get(worker.worker_id, 0) * request.block_chars
        return min(self.cached_tokens(request, worker), int(chars / request.chars_per_token))
