"""Sampler semantics and (seed, position) reproducibility."""

from __future__ import annotations

import pytest
import torch

from shoal.engine.sampler import SamplingRow, position_seed, sample
from shoal.engine.sampling_params import SamplingParams


def row(params: SamplingParams, seed=7, position=10, prompt=(), output=(), banned=()) -> SamplingRow:
    return SamplingRow(params, seed, position, list(prompt), list(output), tuple(banned))


def draws(logits: torch.Tensor, params: SamplingParams, n: int) -> list[int]:
    return [sample(logits[None], [row(params, seed=s)])[0].token_id for s in range(n)]


def test_greedy_picks_argmax_and_respects_bans():
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0])
    assert sample(logits[None], [row(SamplingParams(temperature=0))])[0].token_id == 1
    assert sample(logits[None], [row(SamplingParams(temperature=0), banned=[1])])[0].token_id == 2


def test_same_seed_and_position_gives_same_token_regardless_of_batch():
    torch.manual_seed(0)
    logits = torch.randn(5, 50)
    params = SamplingParams(temperature=1.0)
    alone = sample(logits[2:3], [row(params, seed=42, position=17)])[0].token_id
    batch = sample(logits, [row(params, seed=s, position=17) for s in (1, 2, 42, 3, 4)])
    assert batch[2].token_id == alone
    # Different positions draw different randomness.
    tokens = {sample(logits[2:3], [row(params, seed=42, position=p)])[0].token_id for p in range(40)}
    assert len(tokens) > 1


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    counts = torch.bincount(torch.tensor(draws(probs.log(), SamplingParams(temperature=1.0), 3000)), minlength=3)
    assert torch.allclose(counts / 3000, probs, atol=0.04)


def test_top_k_top_p_min_p_restrict_the_support():
    logits = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0]).log_softmax(-1) * 1.0
    assert set(draws(logits, SamplingParams(temperature=1.0, top_k=2), 300)) <= {0, 1}
    probs = torch.softmax(logits, -1)
    assert probs[0] < 0.9
    assert set(draws(logits, SamplingParams(temperature=1.0, top_p=float(probs[0]) * 0.99), 200)) == {0}
    assert set(draws(logits, SamplingParams(temperature=1.0, min_p=0.5), 300)) <= {
        i for i in range(5) if probs[i] >= 0.5 * probs.max()
    }


def test_penalties_discourage_repeats():
    logits = torch.tensor([2.0, 1.9, -5.0])
    greedy = SamplingParams(temperature=0, repetition_penalty=1.5)
    assert sample(logits[None], [row(greedy, prompt=[0])])[0].token_id == 1
    freq = SamplingParams(temperature=0, frequency_penalty=0.1)
    assert sample(logits[None], [row(freq, output=[0, 0])])[0].token_id == 1
    presence = SamplingParams(temperature=0, presence_penalty=0.2)
    assert sample(logits[None], [row(presence, output=[0])])[0].token_id == 1


def test_logprobs_are_raw_model_logprobs():
    logits = torch.tensor([1.0, 2.0, 3.0])
    out = sample(logits[None], [row(SamplingParams(temperature=0, logprobs=2))])[0]
    expected = torch.log_softmax(logits, -1)
    assert out.token_id == 2 and out.logprob == pytest.approx(float(expected[2]))
    assert list(out.top_logprobs) == [2, 1]


def test_position_seed_mixes_both_inputs():
    seeds = {position_seed(s, p) for s in range(20) for p in range(20)}
    assert len(seeds) == 400 and all(0 <= v < 2**63 for v in seeds)


@pytest.mark.parametrize("vocab", [50, 1000, 49152])
def test_a_draw_inverts_the_cumulative_distribution_at_the_rows_uniform(vocab):
    """The native kernel's token is where u times the total weight falls in the running sum of
    softmax(logits / T) (float64 reference; a token's bounds allow the float32 weights' rounding);
    tokens at -inf are never drawn."""
    from shoal.engine.sampler import _draw_rows

    torch.manual_seed(vocab)
    logits = torch.randn(64, vocab) * 3
    logits[:, ::7] = float("-inf")
    rows = [row(SamplingParams(temperature=0.5 + i / 64), seed=i, position=3 * i) for i in range(64)]
    tokens = _draw_rows(logits, rows).tolist()
    for i, (token, r) in enumerate(zip(tokens, rows)):
        weights = torch.softmax(logits[i].double() / r.params.temperature, -1)
        cumulative = weights.cumsum(-1)
        u = position_seed(r.seed, r.position) / 2**63
        below = float(cumulative[token - 1]) if token else 0.0
        assert token % 7 and below - 1e-5 <= u <= float(cumulative[token]) + 1e-5, (i, token, u)


def test_logit_bias_forbids_and_forces_tokens_before_the_grammar_and_alone_as_in_a_batch():
    logits = torch.tensor([0.1, 3.0, 2.0, -1.0])
    greedy = SamplingParams(temperature=0)
    assert sample(logits[None], [row(SamplingParams(temperature=0, logit_bias=((1, -100.0),)))])[0].token_id == 2
    assert sample(logits[None], [row(SamplingParams(temperature=0, logit_bias=((3, 100.0),)))])[0].token_id == 3
    forced = SamplingParams(temperature=1.0, logit_bias=((0, 100.0),))
    assert set(draws(logits, forced, 50)) == {0}
    # The grammar's mask comes after: a forced token the grammar forbids is not drawn.
    allowed = torch.tensor([False, True, True, False])
    masked = SamplingRow(forced, 7, 10, [], [], (), allowed)
    assert sample(logits[None], [masked])[0].token_id in (1, 2)
    # A biased row draws alone what it draws among others, seeded.
    torch.manual_seed(1)
    table = torch.randn(4, 64)
    biased = SamplingParams(temperature=0.9, seed=3, logit_bias=((5, 4.0), (9, -3.0)))
    alone = [sample(table[2:3], [row(biased, seed=3, position=p)])[0].token_id for p in range(20)]
    neighbours = [row(greedy), row(SamplingParams(temperature=1.0))]
    batched = [
        sample(table, [*neighbours, row(biased, seed=3, position=p), row(greedy)])[2].token_id for p in range(20)
    ]
    assert alone == batched and 5 in alone
