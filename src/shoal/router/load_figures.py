"""A worker's load and speeds as routers read them: the one declaration shared by the router's
reading of a report (fleet.load_report.LoadReport) and the view a routing policy sees
(views.WorkerView), which the simulator's router builds the same way.

The worker's wire schema is protocol.worker_load.WorkerLoad; LoadReport.from_shoal reads it into
these figures (blocks into tokens, its calibration into a single step's seconds), and the metrics of
other servers give some of them.
"""

from __future__ import annotations

import msgspec

from shoal.protocol.worker_load import Role


class LoadFigures(msgspec.Struct, frozen=True, kw_only=True):
    """None where the worker does not say. Invariant: counts are non-negative.

    KV figures are tokens (the longest sequence its cache, or its free blocks, would hold); speeds
    are its recent measurements; `single_step_s` is one sequence's decode step at calibration;
    `unmeasured`: it has generated nothing since it started, so its speeds are the calibration's."""

    running: int = 0
    waiting: int = 0
    max_num_seqs: int | None = None
    free_kv_tokens: int | None = None
    kv_capacity_tokens: int | None = None
    max_model_len: int | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    decode_step_s: float | None = None
    decode_step_noise: float | None = None  # how far its steps fall from decode_step_s, relative to it
    # The tokens a decoding sequence gets a step there: 1, plus the drafts it keeps where it speculates.
    decode_tokens_per_step: float | None = None
    single_step_s: float | None = None
    capability: float | None = None
    unmeasured: bool = False
    role: Role = "colocated"  # colocated, prefill or decode (shoal.router.placement.worker_roles)
    kv_tier_tokens: int | None = None  # held below the paged cache (shoal.router.placement.tier_cost)
    kv_tier_load_tokens_per_s: float | None = None
    # LoRA: the adapters held in memory (the others it serves are read from their files first), how
    # many it holds at most, a read's recent seconds, whether a router may load more there.
    lora_held: frozenset[str] = frozenset()
    lora_capacity: int | None = None
    lora_load_s: float | None = None
    lora_on_demand: bool = False


FIGURE_NAMES = LoadFigures.__struct_fields__


def figures_of(source: LoadFigures) -> dict[str, object]:
    """The figures of a report or a view, by name, to build another struct that carries them."""
    return {name: getattr(source, name) for name in FIGURE_NAMES}
