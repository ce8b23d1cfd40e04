"""Token selection: penalties, temperature, top-k/top-p/min-p, and reproducible randomness.

The random draw for the token at absolute position p of a request depends only on (seed, p): a
fresh generator is seeded from both, and sampling is an exponential race (argmax of p_i / E_i with
E_i ~ Exp(1)), which is equivalent to drawing from p. Together with batch-invariant logits, a
request yields the same tokens alone, batched, preempted, or resumed from a prefix elsewhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shoal.engine.sampling_params import SamplingParams
from shoal.model.native_kernels import load_native_kernels

_MASK64 = (1 << 64) - 1


def position_seed(seed: int, position: int) -> int:
    """SplitMix64 of (seed, position): well-mixed, platform independent, 63-bit for torch."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 0x632BE59BD9B4E019) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: dict[int, float] | None = None


@dataclass(frozen=True)
class SamplingRow:
    """Everything needed to pick one token: the request's params and history, and where it lands."""

    params: SamplingParams
    seed: int
    position: int
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    banned_token_ids: tuple[int, ...] = ()
    # bool [vocab]: the only tokens the request's grammar allows next (None: no grammar).
    allowed: torch.Tensor | None = None
    # The one token the grammar allows, where it allows just one: whatever the sampling settings,
    # it is the token drawn.
    only_token: int | None = None


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
    """logits: float32 [len(rows), vocab]. Each row's result depends on that row alone."""
    plain = [i for i, row in enumerate(rows) if _is_plain_greedy(row)]
    greedy = logits if len(plain) == len(rows) else logits[plain]  # no copy when every row is greedy
    picked = dict(zip(plain, _argmax_rows(greedy).tolist())) if plain else {}
    picked.update((i, row.only_token) for i, row in enumerate(rows) if _is_forced(row))
    return [SampledToken(picked[i]) if i in picked else _sample_row(logits[i], row) for i, row in enumerate(rows)]


def _is_forced(row: SamplingRow) -> bool:
    """The grammar leaves one token (and no logprobs are asked for): no need to look at the logits."""
    return row.only_token is not None and row.params.logprobs is None


def _argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest logit (the first NaN, if any): the native kernel on CPUs that have
    it (torch's argmax over a large vocabulary runs on one core), else torch's."""
    kernels = load_native_kernels() if logits.device.type == "cpu" else None
    return kernels.argmax_rows(logits) if kernels is not None else logits.argmax(dim=-1)


def _is_plain_greedy(row: SamplingRow) -> bool:
    """Greedy with nothing that alters the logits: a row-wise argmax is the whole job."""
    p = row.params
    return (
        p.greedy
        and p.logprobs is None
        and not row.banned_token_ids
        and row.allowed is None
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
    )


def _sample_row(logits: torch.Tensor, row: SamplingRow) -> SampledToken:
    params = row.params
    raw_logprobs = torch.log_softmax(logits, dim=-1) if params.logprobs is not None else None
    logits = _apply_penalties(logits.clone(), row)
    if row.banned_token_ids:
        logits[list(row.banned_token_ids)] = float("-inf")
    if row.allowed is not None:
        logits = torch.where(row.allowed, logits, float("-inf"))
    if params.greedy:
        token = int(_argmax_rows(logits.unsqueeze(0))[0])
    else:
        token = _draw(_filtered_probs(logits, params), row.seed, row.position)
    if raw_logprobs is None:
        return SampledToken(token)
    top = {}
    if params.logprobs:
        values, ids = raw_logprobs.topk(params.logprobs)
        top = {int(i): float(v) for i, v in zip(ids, values)}
    return SampledToken(token, float(raw_logprobs[token]), top)


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    params = row.params
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(
            sorted(set(row.prompt_token_ids) | set(row.output_token_ids)), dtype=torch.long, device=logits.device
        )
        if len(seen):
            picked = logits[seen]
            logits[seen] = torch.where(
                picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty
            )
    if (params.presence_penalty or params.frequency_penalty) and row.output_token_ids:
        ids, counts = torch.tensor(row.output_token_ids, dtype=torch.long).unique(return_counts=True)
        ids, counts = ids.to(logits.device), counts.to(logits.device, torch.float32)
        logits[ids] -= params.frequency_penalty * counts + params.presence_penalty
    return logits


def _filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True, stable=True)
        before = sorted_probs.cumsum(-1) - sorted_probs
        drop = order[before > params.top_p]
        probs[drop] = 0.0
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs


def _draw(probs: torch.Tensor, seed: int, position: int) -> int:
    generator = torch.Generator(device="cpu").manual_seed(position_seed(seed, position))
    noise = torch.empty(probs.shape[-1], dtype=torch.float32).exponential_(generator=generator)
    return int(torch.argmax(probs.cpu() / noise))
