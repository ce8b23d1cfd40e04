"""Token selection: penalties, temperature, top-k/top-p/min-p, and reproducible randomness.

The random draw for the token at absolute position p of a request depends only on (seed, p) and the
row's logits: a uniform u in [0, 1) is mixed from both (SplitMix64), and the token is the inverse of
the cumulative distribution of softmax(logits / temperature) at u, over the tokens the filters keep
(filtered ones are -inf). Every drawing row of a step goes to one native call (csrc/categorical_cpu.cpp:
each row's weights summed in one fixed order, so its token depends on that row alone). Together with
batch-invariant logits, a request yields the same tokens alone, batched, preempted, or resumed from
a prefix elsewhere.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from shoal.engine.sampling_params import SamplingParams
from shoal.engine.sequence import Sequence
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

    @classmethod
    def after(
        cls,
        seq: Sequence,
        drafts: list[int],
        banned_token_ids: tuple[int, ...] = (),
        allowed: torch.Tensor | None = None,
        only_token: int | None = None,
    ) -> SamplingRow:
        """How the token after `seq`'s tokens and `drafts` is drawn: at its own position, with
        `drafts` taken as output (penalties count them)."""
        return cls(
            seq.params,
            seq.seed,
            seq.num_tokens + len(drafts),
            seq.prompt_token_ids,
            seq.output_token_ids + drafts if drafts else seq.output_token_ids,
            banned_token_ids,
            allowed,
            only_token,
        )

    def without_logprobs(self) -> SamplingRow:
        """This row with no logprobs asked for (a draft's: only its token is used)."""
        if self.params.logprobs is None:
            return self
        return dataclasses.replace(self, params=dataclasses.replace(self.params, logprobs=None))


def sample(logits: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
    """logits: float32 [len(rows), vocab]. Each row's result depends on that row alone."""
    plain = [i for i, row in enumerate(rows) if _is_plain_greedy(row)]
    greedy = logits if len(plain) == len(rows) else logits[plain]  # no copy when every row is greedy
    picked = dict(zip(plain, _argmax_rows(greedy).tolist())) if plain else {}
    picked.update((i, row.only_token) for i, row in enumerate(rows) if _is_forced(row))
    chosen = [i for i in range(len(rows)) if i not in picked]
    scores = {i: _scores(logits[i], rows[i]) for i in chosen if not _is_plain_draw(rows[i])}
    greedy_rows = [i for i in chosen if rows[i].params.greedy]
    if greedy_rows:
        best = _argmax_rows(torch.stack([scores[i] for i in greedy_rows]))
        picked.update(zip(greedy_rows, best.tolist()))
    drawn = [i for i in chosen if not rows[i].params.greedy]
    if drawn:
        every = len(drawn) == len(rows) and not scores  # the logits as they are: no copy
        table = logits if every else torch.stack([scores.get(i, logits[i]) for i in drawn])
        picked.update(zip(drawn, _draw_rows(table, [rows[i] for i in drawn]).tolist()))
    return [_with_logprobs(logits[i], row, picked[i]) for i, row in enumerate(rows)]


def _is_forced(row: SamplingRow) -> bool:
    """The grammar leaves one token (and no logprobs are asked for): no need to look at the logits."""
    return row.only_token is not None and row.params.logprobs is None


def _argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's first largest logit (the first NaN, if any): the native kernel on CPUs that have
    it (torch's argmax over a large vocabulary runs on one core), else torch's."""
    kernels = load_native_kernels() if logits.device.type == "cpu" else None
    return kernels.argmax_rows(logits) if kernels is not None else logits.argmax(dim=-1)


def _unaltered(row: SamplingRow) -> bool:
    """Nothing changes the row's logits: no bias, penalty, banned token or grammar mask."""
    p = row.params
    return (
        not p.logit_bias
        and not row.banned_token_ids
        and row.allowed is None
        and p.repetition_penalty == 1.0
        and not p.presence_penalty
        and not p.frequency_penalty
    )


def _is_plain_greedy(row: SamplingRow) -> bool:
    """Greedy with nothing that alters the logits: a row-wise argmax is the whole job."""
    return row.params.greedy and row.params.logprobs is None and _unaltered(row)


def _is_plain_draw(row: SamplingRow) -> bool:
    """A draw at a temperature from the logits as they are: no filter to apply first."""
    p = row.params
    return not p.greedy and _unaltered(row) and p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0


def _scores(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """The row's logits after its logit bias, penalties, banned tokens and the grammar's mask; for a
    draw, also -inf for every token top-k, top-p and min-p drop (the distribution they leave,
    renormalized)."""
    params = row.params
    scores = logits.clone()
    if params.logit_bias:
        ids, values = zip(*params.logit_bias)
        scores[list(ids)] += torch.tensor(values, dtype=scores.dtype, device=scores.device)
    scores = _apply_penalties(scores, row)
    if row.banned_token_ids:
        scores[list(row.banned_token_ids)] = float("-inf")
    if row.allowed is not None:
        scores = torch.where(row.allowed, scores, float("-inf"))
    if params.greedy:
        return scores
    return scores.masked_fill(_dropped(scores, params), float("-inf"))


def _with_logprobs(logits: torch.Tensor, row: SamplingRow, token: int) -> SampledToken:
    params = row.params
    if params.logprobs is None:
        return SampledToken(token)
    raw_logprobs = torch.log_softmax(logits, dim=-1)
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


def _dropped(scores: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """bool [vocab]: the tokens top-k, top-p and min-p leave out at the row's temperature (top-p
    keeps the fewest most probable tokens whose mass reaches top_p)."""
    scaled = scores / params.temperature
    dropped = torch.zeros_like(scores, dtype=torch.bool)
    if 0 < params.top_k < scores.shape[-1]:
        dropped |= scaled < torch.topk(scaled, params.top_k).values[-1]
    probs = torch.softmax(scaled.masked_fill(dropped, float("-inf")), dim=-1)
    if params.top_p < 1.0:
        dropped = torch.ones_like(dropped)  # the nucleus lies within what top-k kept
        dropped[_nucleus(probs, params.top_p)] = False
    if params.min_p > 0.0:
        dropped |= probs < params.min_p * probs.max()
    return dropped


def _nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The indices of the fewest most probable tokens whose mass reaches top_p (ties in the order
    torch.topk gives them). The most probable few hundred usually hold it: only where they do not
    are more, up to the whole vocabulary, sorted."""
    k = min(probs.shape[-1], 256)
    while True:
        values, order = torch.topk(probs, k)
        before = values.cumsum(-1) - values
        if bool(before[-1] > top_p) or k == probs.shape[-1]:
            return order[before <= top_p]
        k = min(probs.shape[-1], 8 * k)


def _draw_rows(scores: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row of `scores` (float32 [len(rows), vocab], -inf where filtered), drawn at the
    row's temperature at its uniform for (seed, position): the native kernel, else the same
    inverse-CDF draw in torch (summed in torch's order, so its tokens may differ in the last place)."""
    inverse = torch.tensor([1.0 / row.params.temperature for row in rows], dtype=torch.float32)
    uniforms = torch.tensor([position_seed(row.seed, row.position) / 2**63 for row in rows], dtype=torch.float64)
    scores = scores.float().contiguous().cpu()
    kernels = load_native_kernels()
    if kernels is not None:
        return kernels.sample_rows(scores, inverse, uniforms)
    weights = torch.softmax(scores * inverse[:, None], dim=-1).double().cumsum(-1)
    targets = uniforms[:, None] * weights[:, -1:]
    return torch.searchsorted(weights, targets, right=True).clamp(max=scores.shape[-1] - 1).squeeze(-1)
