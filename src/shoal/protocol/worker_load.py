"""What a worker tells routers about itself: its load report (`GET /load`, and the body of every
heartbeat), its registration and its heartbeat. One schema each, encoded and decoded by both ends.

JSON on the wire. Every figure but the two queue lengths may be absent (None: the worker does not
say); counts are never negative. Unknown keys are ignored, so a newer worker can report more to an
older router. A body that does not fit the schema is refused whole (`decode_*` raise ValueError
with msgspec's reason), never half-read.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

Count = Annotated[int, msgspec.Meta(ge=0)]
Rate = Annotated[float, msgspec.Meta(ge=0)]
Fraction = Annotated[float, msgspec.Meta(ge=0, le=1)]
# colocated: prefill and decode; prefill: hands each stream off after its first token; decode: takes
# the continuations (shoal.worker.kv_mobility).
Role = Literal["colocated", "prefill", "decode"]


class CalibrationFigures(msgspec.Struct, frozen=True, kw_only=True):
    """Speeds measured at start-up (engine.calibration), over `seconds` when said; `capability`,
    when said, is the batched decode rate routers compare across heterogeneous replicas."""

    prefill_tokens_per_s: Rate
    decode_tokens_per_s: Rate
    batched_decode_tokens_per_s: Rate
    batch: Count
    capability: Rate | None = None
    seconds: Rate | None = None


class LoraLoad(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's LoRA adapters: those it serves by name (`adapters`: requests name them as `model`),
    those of them held in memory now (`held`, least recently used first, at most `capacity`; the
    others are read again from their files when asked for), those whose files are being read
    (`loading`), the reads since it started (`loads`: first reads and reads after an adapter was
    given back), a read's recent seconds (`load_s`, None before any), and whether a router may load
    more there (`on_demand`: it reads adapters at run time from its lora_dir)."""

    adapters: list[str] = []
    held: list[str] = []
    capacity: Count | None = None
    loading: list[str] = []
    loads: Count = 0
    load_s: Rate | None = None
    on_demand: bool = False


class WorkerLoad(msgspec.Struct, frozen=True, kw_only=True):
    """A worker's load report. Blocks are `block_size` tokens; `kv_capacity_tokens` and
    `free_kv_tokens` are the longest sequence its KV cache, or its free blocks, would hold (counted
    per KV group: a sliding-window layer holds only its window; without them, blocks times
    block_size); `kv_cache_budget_bytes` is the KV
    budget the engine was given; speeds are the engine's recent measurements, `longest_step_s` how
    long its longest step now should take (a full prefill chunk beside its running sequences).
    `server` is "shoal" in every report a shoal worker sends: other servers answer /load too (vLLM
    with its own JSON), and a router polling one tells them apart by it."""

    server: str | None = None
    model: str | None = None
    max_model_len: Count | None = None
    draining: bool = False
    running: Count = 0
    waiting: Count = 0
    max_num_seqs: Count | None = None
    outstanding_prefill_tokens: Count | None = None
    outstanding_decode_tokens: Count | None = None
    free_kv_blocks: Count | None = None
    num_kv_blocks: Count | None = None
    block_size: Count | None = None
    kv_capacity_tokens: Count | None = None
    free_kv_tokens: Count | None = None
    kv_cache_budget_bytes: Count | None = None
    kv_cache_usage: Fraction | None = None
    prefill_tokens_per_s: Rate | None = None
    decode_tokens_per_s: Rate | None = None
    decode_step_s: Rate | None = None
    decode_step_noise: Rate | None = None  # relative spread of decode steps about decode_step_s
    decode_tokens_per_step: Rate | None = None  # a decoding sequence's tokens a step: 1 + drafts kept
    draft_tokens: Count | None = None  # speculative drafts scored since start, and those kept
    lora: LoraLoad | None = None  # None: it serves no LoRA adapters
    accepted_draft_tokens: Count | None = None
    longest_step_s: Rate | None = None
    capability: Rate | None = None
    calibration: CalibrationFigures | None = None
    generated_tokens: Count | None = None  # since start; 0: the speeds above are still the calibration's
    role: Role = "colocated"
    kv_peer: str | None = None  # the ZeroMQ address other workers fetch this worker's KV blocks from
    kv_tier_tokens: Count | None = None  # what its KV tier below the paged cache holds (None: no tier)
    kv_tier_load_tokens_per_s: Rate | None = None  # measured copying blocks back from the tier


class Registration(msgspec.Struct, frozen=True, kw_only=True):
    """`POST /admin/workers`: a worker joins at `url`, serving `models`."""

    url: Annotated[str, msgspec.Meta(min_length=1)]
    models: list[str]
    load: WorkerLoad | None = None


class RegistrationAccepted(msgspec.Struct, frozen=True, kw_only=True):
    """The router's answer: the worker's id, and how often it must heartbeat to keep its lease."""

    worker_id: str
    lease_s: float
    heartbeat_interval_s: float


class Heartbeat(msgspec.Struct, frozen=True, kw_only=True):
    """`POST /admin/workers/heartbeat`: the worker is alive, with its load now."""

    worker_id: str
    load: WorkerLoad | None = None


def encode(message: msgspec.Struct) -> bytes:
    return msgspec.json.encode(message)


def _decoder(kind: type):
    decoder = msgspec.json.Decoder(kind)

    def decode(body: bytes) -> kind:
        try:
            return decoder.decode(body)
        except msgspec.DecodeError as exc:  # ValidationError included
            raise ValueError(str(exc)) from None

    decode.__doc__ = f"A {kind.__name__} from its JSON; ValueError naming what does not fit."
    return decode


decode_load = _decoder(WorkerLoad)
decode_registration = _decoder(Registration)
decode_heartbeat = _decoder(Heartbeat)
decode_registration_accepted = _decoder(RegistrationAccepted)
